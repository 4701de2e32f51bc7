"""help(skistune.optimize) and help(skistune.evaluate) show a module page (each name is both a module and its main
function): the function's signature and text come first on it (a reader had found them 587 lines down)."""
from __future__ import annotations

import inspect
import pydoc

import pytest

import skistune


@pytest.mark.parametrize("name", ["optimize", "evaluate"])
def test_help_opens_with_the_function(name):
    module = getattr(skistune, name)
    function = getattr(__import__(f"skistune.{name}", fromlist=[name]), name)
    page = pydoc.render_doc(module, renderer=pydoc.plaintext).splitlines()
    first_line = inspect.getdoc(function).splitlines()[0]
    assert any(first_line in line for line in page[:12]), page[:12]
    assert any(f"skistune.{name}(" in line for line in page[:5])
