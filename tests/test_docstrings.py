"""Every public name has a docstring: the API reference (docs/reference/, built by mkdocstrings) is generated from them.

Public: every name not starting with ``_`` that a package below exports (its ``__all__`` where it has one), and for a
class defined in dearopt, every public method and property defined in that class's own body.  Modules are skipped
(their public names are checked where they are exported, or listed here: ``dearopt.checkpoint`` and
``dearopt.integrations.horovod.elastic``).
"""

import importlib
import inspect

import pytest

PACKAGES = [
    "dearopt",
    "dearopt.integrations.horovod",
    "dearopt.sim",
    "dearopt.integrations.lightning",
    "dearopt.integrations.transformers",
    "dearopt.checkpoint",
    "dearopt.integrations.horovod.elastic",
]


def _public_names(module):
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return sorted(names)


def _member_function(value):
    """The function behind a class attribute (method, static/class method, property getter), or None."""
    if isinstance(value, property):
        return value.fget
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__
    if inspect.isfunction(value):
        return value
    return None


def _undocumented(package_name):
    module = importlib.import_module(package_name)
    missing = []
    for name in _public_names(module):
        obj = getattr(module, name)
        if inspect.ismodule(obj) or not callable(obj):
            continue  # constants (hvd.Average, ...) and submodules
        qualified = f"{package_name}.{name}"
        if inspect.isclass(obj):
            if not (obj.__dict__.get("__doc__") or "").strip():
                missing.append(qualified)
            if not (obj.__module__ or "").startswith("dearopt"):
                continue
            for attr, value in vars(obj).items():
                function = _member_function(value)
                if attr.startswith("_") or function is None:
                    continue
                if not (function.__doc__ or "").strip():
                    missing.append(f"{qualified}.{attr}")
        elif not (inspect.getdoc(obj) or "").strip():
            missing.append(qualified)
    return missing


@pytest.mark.parametrize("package_name", PACKAGES)
def test_public_names_have_docstrings(package_name):
    if package_name == "dearopt.integrations.lightning":
        pytest.importorskip("lightning")
    if package_name == "dearopt.integrations.transformers":
        pytest.importorskip("transformers")
        pytest.importorskip("accelerate")
    missing = _undocumented(package_name)
    assert not missing, f"{len(missing)} public names without a docstring: " + ", ".join(missing)


def test_the_walk_sees_what_it_should():
    # the check itself: a known public method and a known function are found, and a private one is not
    import dearopt

    found = {a for a, v in vars(dearopt.DistOptim).items() if not a.startswith("_") and _member_function(v)}
    assert {"step", "zero_grad", "clip_grad_norm_", "state_dict"} <= found
    assert "init" in _public_names(dearopt)
    assert not any(n.startswith("_") for n in _public_names(dearopt))


def test_the_api_reference_lists_every_public_name():
    # docs/reference/dearopt.md names each export (`::: dearopt.NAME`); a new export must be added there too
    import os

    import dearopt

    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "reference", "dearopt.md")).read()
    listed = {line.split("::: dearopt.", 1)[1].strip() for line in page.splitlines() if line.startswith("::: dearopt.")}
    missing = sorted(set(dearopt.__all__) - listed)
    assert not missing, f"docs/reference/dearopt.md does not list: {', '.join(missing)}"
