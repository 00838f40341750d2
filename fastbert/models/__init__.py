"""The families fastbert accelerates, one module each. A family module writes one class per transformers module it
fuses (``class BertLayer(layers.FusedLayer, hf.BertLayer)``), maps transformers' classes to them in ``FUSED_CLASSES``
and ``HEAD_CLASSES`` (head modules with a fused forward, e.g. the MLM transform), and defines its model class
(``modeling.FusedModel`` + transformers' ``*Model``). Adding a family: write its module (``bert.py`` is the example to
copy; ``gte.py`` for rotary positions and a GLU MLP, ``mpnet.py`` for a relative-position bias, ``deberta_v2.py`` for
DeBERTa's disentangled position terms) and list it here
(docs/architecture.md)."""

import importlib.util

import transformers

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
# The families added with transformers 5.x, where the installed transformers has them as 5.x does (4.x's ModernBERT
# and MPNet are other module trees): (transformers' package, our model class) each; our module has the package's name.
_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
for _package, _model in (("gte", "GteModel"), ("nomic_bert", "NomicBertModel"), ("modernbert", "ModernBertModel"),
                         ("mpnet", "MPNetModel"), ("deberta_v2", "DebertaV2Model"), ("deberta", "DebertaModel")):
    if not _TRANSFORMERS_5 or importlib.util.find_spec(f"transformers.models.{_package}") is None:
        UNAVAILABLE[_model] = f"needs transformers 5.x with transformers.models.{_package}"
        continue
    FAMILIES.append(importlib.import_module(f".{_package}", __name__))
    MODELS.append(getattr(FAMILIES[-1], _model))
    globals()[_model] = MODELS[-1]

# transformers' model class -> ours
MODEL_CLASSES = {model.hf_class: model for model in MODELS}
HEAD_CLASSES = {theirs: ours for family in FAMILIES for theirs, ours in family.HEAD_CLASSES.items()}
