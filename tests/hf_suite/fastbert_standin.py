"""pytest plugin: run transformers' own model tests with fastbert standing in for transformers' BERT-family models
(``BertModel``, ``RobertaModel``, ``XLMRobertaModel``, ``CamembertModel``, ``ElectraModel``, ``DistilBertModel``, ``GteModel``,
``NomicBertModel``, ``ModernBertModel``, ``MPNetModel``, ``DebertaV2Model``, ``DebertaModel``).

Load it with ``-p fastbert_standin`` (this directory on PYTHONPATH) and pick the mode with an environment variable:

    FASTBERT_STANDIN=none       plain transformers (the baseline); only records outcomes
    FASTBERT_STANDIN=rebind     each family's ``*Model`` name is bound to fastbert's class everywhere a test or a
                                head looks it up, before any test module is imported
    FASTBERT_STANDIN=optimize   every BERT-family model the tests build (``BertFor*(config)``, ``from_config``) or
                                load (``from_pretrained``) goes through ``fastbert.optimize()`` as soon as it exists

FASTBERT_STANDIN_REPORT=path.json writes every test's outcome there (see ``_Recorder``); ``run.py`` reads it.
Nothing here edits files: the stand-in lives in this process only.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time

MODES = ("none", "rebind", "optimize")

_state = {
    "mode": "none",
    "bert_models_built": 0,  # BERT-family models built or loaded (outermost only: a head counts once, not its encoder)
    "with_fastbert": 0,  # ... of those, how many run fastbert modules once built (optimize: once optimized)
    "optimized": 0,  # optimize mode: fastbert.optimize() calls made by the plugin
    "optimize_errors": 0,  # optimize mode: how many of those raised
}
_tls = threading.local()


def _mode() -> str:
    mode = os.environ.get("FASTBERT_STANDIN", "none").strip().lower() or "none"
    if mode not in MODES:
        raise ValueError(f"FASTBERT_STANDIN={mode!r}: expected one of {', '.join(MODES)}")
    return mode


# (transformers' subpackage, its modeling module, the model class name) per family fastbert covers
FAMILIES = (
    ("bert", "modeling_bert", "BertModel"),
    ("roberta", "modeling_roberta", "RobertaModel"),
    ("xlm_roberta", "modeling_xlm_roberta", "XLMRobertaModel"),
    ("camembert", "modeling_camembert", "CamembertModel"),
    ("electra", "modeling_electra", "ElectraModel"),
    ("distilbert", "modeling_distilbert", "DistilBertModel"),
    ("gte", "modeling_gte", "GteModel"),
    ("nomic_bert", "modeling_nomic_bert", "NomicBertModel"),
    ("modernbert", "modeling_modernbert", "ModernBertModel"),
    ("mpnet", "modeling_mpnet", "MPNetModel"),
    ("deberta_v2", "modeling_deberta_v2", "DebertaV2Model"),
    ("deberta", "modeling_deberta", "DebertaModel"),
)


def _hf_modules() -> list:
    import importlib

    return [importlib.import_module(f"transformers.models.{package}.{module}") for package, module, _ in FAMILIES]


# transformers' own model classes, captured before any rebinding.
_ORIGINAL_MODELS: tuple = ()


def _fastbert_classes() -> tuple:
    fastbert = sys.modules.get("fastbert")  # never imported by the baseline ("none") run
    return tuple(getattr(fastbert, name) for _, _, name in FAMILIES) if fastbert is not None else ()


def _has_fastbert(model) -> bool:
    return any(type(m).__module__.split(".")[0] == "fastbert" for m in model.modules())


def _is_bert_model(model) -> bool:
    bert_classes = (*_ORIGINAL_MODELS, *_fastbert_classes())
    return any(isinstance(m, bert_classes) for m in model.modules())


def _needs_optimize(model) -> bool:
    """A BERT-family encoder in ``model`` is still transformers' own class (fastbert.optimize would swap it)."""
    return any(type(m) in _ORIGINAL_MODELS for m in model.modules())


def _count_built(model) -> None:
    _state["bert_models_built"] += 1
    if _has_fastbert(model):
        _state["with_fastbert"] += 1


# ----------------------------------------------------------------------------------------------------------------
# Construction tracking (all modes). The BERT classes' __init__ are wrapped with a depth counter, so that the
# callback sees each *outermost* model once it is complete: BertForMaskedLM(config) is reported after its whole
# __init__ (encoder and head included) has run, never its inner BertModel on its own. Exception-safe by
# construction (try/finally), unlike tracking post_init calls.
# ----------------------------------------------------------------------------------------------------------------


def _depth() -> int:
    return getattr(_tls, "depth", 0)


def _loading() -> int:
    return getattr(_tls, "loading", 0)


def _wrap_init(cls, on_outermost_built) -> None:
    original = cls.__dict__["__init__"]
    if getattr(original, "_fastbert_standin", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        outermost = _depth() == 0
        _tls.depth = _depth() + 1
        try:
            original(self, *args, **kwargs)
        finally:
            _tls.depth -= 1
        if outermost:
            on_outermost_built(self)

    __init__._fastbert_standin = True
    cls.__init__ = __init__


def _install_construction_hooks(on_outermost_built) -> None:
    from transformers import PreTrainedModel

    classes = [
        obj
        for hf in _hf_modules()
        for obj in vars(hf).values()
        if isinstance(obj, type) and issubclass(obj, PreTrainedModel) and "__init__" in obj.__dict__
    ]
    classes += [c for c in _fastbert_classes() if "__init__" in c.__dict__]
    for cls in classes:
        _wrap_init(cls, on_outermost_built)


# ----------------------------------------------------------------------------------------------------------------
# Modes
# ----------------------------------------------------------------------------------------------------------------


def _rebind() -> None:
    """Bind each family's model name to fastbert's class wherever transformers and the tests resolve it."""
    import importlib

    import transformers

    import fastbert

    for (package, _, name), hf in zip(FAMILIES, _hf_modules()):
        ours = getattr(fastbert, name)
        # The heads build their encoder with ``self.bert = BertModel(config, ...)``: a global of the modeling module.
        setattr(hf, name, ours)
        # ``from transformers import BertModel``, ``transformers.models.bert.BertModel`` and the auto mappings
        # (AutoModel resolves class names on transformers.models.<family>) all read these attributes. transformers'
        # lazy modules cache what they resolved, so set them outright.
        setattr(importlib.import_module(f"transformers.models.{package}"), name, ours)
        setattr(transformers, name, ours)
    # Tests that fetch a fresh top-level module later (transformers' test_pipeline_mixin re-executes
    # transformers/__init__.py from the checkout) resolve BertModel through the submodules above again.


def _optimize_now(model) -> None:
    import fastbert

    if not _needs_optimize(model):
        return
    _state["optimized"] += 1
    try:
        fastbert.optimize(model)
    except BaseException:
        _state["optimize_errors"] += 1
        raise


def _install_optimize_hooks() -> None:
    """Built models are optimized when their outermost __init__ completes; loaded ones once from_pretrained returns
    (optimizing the meta-device skeleton from_pretrained builds first is not what a user does)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        _tls.loading = _loading() + 1
        try:
            result = original(cls, *args, **kwargs)
        finally:
            _tls.loading -= 1
        if _loading() == 0:
            model = result[0] if isinstance(result, tuple) else result
            if isinstance(model, PreTrainedModel) and _is_bert_model(model):
                _optimize_now(model)
                _count_built(model)
        return result

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _on_built(model) -> None:
    if _state["mode"] == "optimize":
        if _loading():
            return  # counted and optimized when from_pretrained returns
        _optimize_now(model)
    _count_built(model)


def _fallbacks_seen() -> dict:
    """fastbert's record of the calls it left to transformers' implementation ({reason: count}), when it keeps one."""
    announce = sys.modules.get("fastbert.announce")
    seen = getattr(announce, "seen", None)
    try:
        return dict(seen()) if callable(seen) else {}
    except Exception:  # an internal API of fastbert: never let it break a run
        return {}


# ----------------------------------------------------------------------------------------------------------------
# Outcome recording
# ----------------------------------------------------------------------------------------------------------------

_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 2, "failed": 3, "error": 4}


def _first_line(report) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # skip: (path, lineno, reason)
        text = str(longrepr[2])
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    first = lines[0]
    if len(lines) > 1 and ("tensor(" in first or first.endswith(":")):
        # a multi-line message (a tensor dump, a list): its last line usually says what was expected
        first = f"{first[:120]} ... {lines[-1]}"
    return first[:300]


class _Recorder:
    """nodeid -> {"outcome": passed|failed|error|skipped|xfailed|xpassed, "reason": first line, "duration": s}.

    A failing setup or teardown makes the test an "error"; a module that fails to import is recorded under its own
    nodeid as an "error" (its tests then are missing from the results).
    """

    def __init__(self, path: str | None):
        self.path = path
        self.results: dict[str, dict] = {}
        self.started = time.time()

    def _set(self, nodeid: str, outcome: str, reason: str, duration: float = 0.0) -> None:
        old = self.results.get(nodeid)
        if old is None:
            self.results[nodeid] = {"outcome": outcome, "reason": reason, "duration": round(duration, 3)}
            return
        old["duration"] = round(old["duration"] + duration, 3)
        if _RANK[outcome] > _RANK[old["outcome"]]:
            old["outcome"], old["reason"] = outcome, reason

    def pytest_runtest_logstart(self, nodeid, location):
        self._fallbacks_before = _fallbacks_seen()

    def pytest_runtest_logfinish(self, nodeid, location):
        after = _fallbacks_seen()
        before = getattr(self, "_fallbacks_before", {})
        grown = {reason: n - before.get(reason, 0) for reason, n in after.items() if n > before.get(reason, 0)}
        if grown and nodeid in self.results:
            # this test ran (some of) its BERT forwards on transformers' implementation, by fastbert's own account
            self.results[nodeid]["fallbacks"] = sum(grown.values())
            self.results[nodeid]["fallback_reasons"] = sorted(grown)[:5]

    def pytest_runtest_logreport(self, report):
        xfail = hasattr(report, "wasxfail")
        context = getattr(report, "context", None)
        if context is not None and report.when == "call":  # a unittest subTest (pytest >= 9 reports each one)
            entry = self.results.setdefault(report.nodeid, {"outcome": "passed", "reason": "", "duration": 0.0})
            key = "subtests_" + ("xfailed" if xfail else report.outcome)
            entry[key] = entry.get(key, 0) + 1
            if report.failed:  # a failing subtest fails its test; a skipped one does not skip it
                self._set(report.nodeid, "failed", f"[subtest {report._sub_test_description()}] {_first_line(report)}")
            return
        if report.when == "call":
            if xfail:
                outcome = "xfailed" if report.skipped else "xpassed"
                reason = report.wasxfail or _first_line(report)
            else:
                outcome = report.outcome
                reason = _first_line(report) if outcome != "passed" else ""
            self._set(report.nodeid, outcome, reason, report.duration)
        elif report.failed:  # setup / teardown
            self._set(report.nodeid, "error", f"[{report.when}] {_first_line(report)}", report.duration)
        elif report.skipped:  # skipped in setup (skip markers, unittest.skip)
            outcome = "xfailed" if xfail else "skipped"
            self._set(report.nodeid, outcome, _first_line(report), report.duration)
        else:
            self.results.setdefault(report.nodeid, {"outcome": "passed", "reason": "", "duration": 0.0})

    def pytest_collectreport(self, report):
        if report.failed:
            self._set(report.nodeid or "<collection>", "error", f"[collect] {_first_line(report)}")

    def pytest_sessionfinish(self, session, exitstatus):
        if not self.path:
            return
        info = {"mode": _state["mode"], "exitstatus": int(exitstatus), "seconds": round(time.time() - self.started, 1)}
        info.update({k: v for k, v in _state.items() if k != "mode"})
        info.update(_versions())
        info["fastbert_fallbacks"] = _fallbacks_seen()
        payload = {"info": info, "results": self.results}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def _versions() -> dict:
    out = {}
    for name in ("transformers", "torch", "fastbert"):
        module = sys.modules.get(name)
        if module is not None:
            out[f"{name}_version"] = getattr(module, "__version__", "?")
            out[f"{name}_file"] = getattr(module, "__file__", "?")
    return out


# ----------------------------------------------------------------------------------------------------------------
# pytest hooks
# ----------------------------------------------------------------------------------------------------------------


def pytest_configure(config):
    global _ORIGINAL_MODELS
    mode = _mode()
    _state["mode"] = mode
    _ORIGINAL_MODELS = tuple(getattr(hf, name) for (_, _, name), hf in zip(FAMILIES, _hf_modules()))
    if mode != "none":
        import fastbert  # noqa: F401  (imported before any rebinding: fastbert subclasses transformers' classes)
    _install_construction_hooks(_on_built)
    if mode == "rebind":
        _rebind()
    elif mode == "optimize":
        _install_optimize_hooks()
    config.pluginmanager.register(_Recorder(os.environ.get("FASTBERT_STANDIN_REPORT")), "fastbert_standin_recorder")


def pytest_report_header(config):
    line = f"fastbert stand-in: FASTBERT_STANDIN={_state['mode']}"
    if _state["mode"] != "none":
        import fastbert

        line += f" (fastbert {getattr(fastbert, '__version__', '?')} from {os.path.dirname(fastbert.__file__)})"
    return line


def pytest_terminal_summary(terminalreporter):
    s = _state
    line = (f"fastbert stand-in ({s['mode']}): {s['bert_models_built']} BERT-family models built or loaded, "
            f"{s['with_fastbert']} of them running fastbert modules")
    if s["mode"] == "optimize":
        line += f"; fastbert.optimize() called {s['optimized']} times, {s['optimize_errors']} raised"
    terminalreporter.write_line(line)
    fallbacks = _fallbacks_seen()
    if fallbacks:
        terminalreporter.write_line(f"fastbert fell back to transformers' implementation {sum(fallbacks.values())} "
                                    f"times, for {len(fallbacks)} reasons:")
        for reason, n in sorted(fallbacks.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"  {n:6d}  {reason}")
