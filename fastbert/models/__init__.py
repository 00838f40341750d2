"""The families fastbert accelerates, one module each. A family module defines ``FUSED_CLASSES`` (transformers'
encoder module classes -> ours), ``HEAD_CLASSES`` (head modules with a fused forward, e.g. the MLM transform) and its
model class (``modeling.FusedModel`` + transformers' ``*Model``). Adding a family: write its module (``bert.py`` is
the example to copy) and list it here."""

from .bert import BertModel
from .camembert import CamembertModel
from .distilbert import DistilBertModel
from .electra import ElectraModel
from .gte import GteModel
from .roberta import RobertaModel
from .xlm_roberta import XLMRobertaModel
from . import bert, camembert, distilbert, electra, gte, roberta, xlm_roberta

MODELS = (BertModel, RobertaModel, XLMRobertaModel, CamembertModel, ElectraModel, DistilBertModel, GteModel)
# transformers' model class -> ours
MODEL_CLASSES = {model.hf_class: model for model in MODELS}
HEAD_CLASSES = {
    theirs: ours
    for family in (bert, roberta, xlm_roberta, camembert, electra, distilbert, gte)
    for theirs, ours in family.HEAD_CLASSES.items()
}
