"""The families fastbert accelerates, one module each. A family module defines ``FUSED_CLASSES`` (transformers'
encoder module classes -> ours), ``HEAD_CLASSES`` (head modules with a fused forward, e.g. the MLM transform) and its
model class (``modeling.FusedModel`` + transformers' ``*Model``). Adding a family: write its module (``bert.py`` is
the example to copy; ``gte.py`` for rotary positions and a GLU MLP) and list it here."""

import importlib.util

from . import bert, camembert, distilbert, electra, roberta, xlm_roberta
from .bert import BertModel
from .camembert import CamembertModel
from .distilbert import DistilBertModel
from .electra import ElectraModel
from .roberta import RobertaModel
from .xlm_roberta import XLMRobertaModel

FAMILIES = [bert, roberta, xlm_roberta, camembert, electra, distilbert]
MODELS = [BertModel, RobertaModel, XLMRobertaModel, CamembertModel, ElectraModel, DistilBertModel]
# Families the installed transformers lacks: our class name -> why it is unavailable.
UNAVAILABLE = {}
if importlib.util.find_spec("transformers.models.gte") is not None:
    from . import gte
    from .gte import GteModel

    FAMILIES.append(gte)
    MODELS.append(GteModel)
else:
    UNAVAILABLE["GteModel"] = "the installed transformers has no GTE model (transformers.models.gte)"

# transformers' model class -> ours
MODEL_CLASSES = {model.hf_class: model for model in MODELS}
HEAD_CLASSES = {theirs: ours for family in FAMILIES for theirs, ours in family.HEAD_CLASSES.items()}
