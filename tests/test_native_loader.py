"""The source-checkout fallback of flux_jax/_native.py: a checkout without a built extension
borrows the installed one, and says so when the two packages' Python differs."""

import os
import shutil
import subprocess
import sys

import pytest

import flux_jax
from flux_jax import _native


def _package_copy(root, so_path, edit=None):
    """root/flux_jax with the real package's .py files (one edited) and, if given, the extension."""
    src = os.path.dirname(flux_jax.__file__)
    dst = os.path.join(root, "flux_jax")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    if edit:
        with open(os.path.join(dst, edit), "a") as f:
            f.write("\n# edited\n")
    if so_path:
        os.symlink(so_path, os.path.join(dst, os.path.basename(so_path)))
    return root


def _import_warnings(checkout, installed):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([checkout, installed]), "JAX_PLATFORMS": "cpu"}
    # Only the standard finders: an editable install's redirect finder would take `flux_jax`
    # away from PYTHONPATH.
    code = (
        "import sys, warnings; sys.meta_path[:] = [f for f in sys.meta_path "
        "if f.__module__.startswith('_frozen_importlib')]; "
        "warnings.simplefilter('always'); import flux_jax; "
        "print('LOADED', flux_jax._native._ext.__file__)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=checkout
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "LOADED " + installed in run.stdout
    return run.stderr


def test_differing_sources_lists_only_changed_python_files(tmp_path):
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir(), theirs.mkdir()
    for d, text in ((mine, "x = 1\n"), (theirs, "x = 1\n")):
        (d / "same.py").write_text(text)
    (mine / "changed.py").write_text("a = 1\n")
    (theirs / "changed.py").write_text("a = 2\n")
    (theirs / "only_installed.py").write_text("")
    (mine / "notes.txt").write_text("1")
    (theirs / "notes.txt").write_text("2")
    assert _native._differing_sources(str(mine), str(theirs)) == ["changed.py"]


def test_checkout_borrowing_an_extension_warns_when_the_python_differs(tmp_path):
    so_path = os.path.abspath(_native._ext.__file__)
    if not so_path.endswith((".so", ".pyd")):
        pytest.skip("the extension is not a plain file here")
    installed = _package_copy(str(tmp_path / "site"), so_path)
    same = _package_copy(str(tmp_path / "same"), None)
    edited = _package_copy(str(tmp_path / "edited"), None, edit="_plan.py")
    assert "differs" not in _import_warnings(same, installed)
    err = _import_warnings(edited, installed)
    assert "whose Python differs (_plan.py)" in err, err[-2000:]
