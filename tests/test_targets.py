"""Dotted-path targets: what imports, what is passed, and one-line errors naming the setting."""

import sys

import pytest
import torch

from fdp.errors import ConfigError
from fdp.targets import build, locate


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A package on sys.path with a good module, one whose own import fails and one that does not parse."""
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(
        "import torch\n"
        "SCALE = 2\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self, in_features, num_classes, width=4):\n"
        "        super().__init__()\n"
        "        self.args = (in_features, num_classes, width)\n"
        "        self.fc = torch.nn.Linear(in_features, num_classes)\n"
        "class Broken(torch.nn.Module):\n"
        "    def __init__(self, in_features):\n"
        "        super().__init__()\n"
        "        self.fc = self.missing_attribute\n"
        "def loose(**kwargs):\n"
        "    return kwargs\n"
    )
    (pkg / "needs_missing.py").write_text("import a_module_that_is_not_installed_xyz\n")
    (pkg / "bad_syntax.py").write_text("def (:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "userpkg"
    for name in [m for m in sys.modules if m.startswith("userpkg")]:
        del sys.modules[name]


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_locate_finds_classes_functions_and_nested_attributes(user_package):
    assert locate("model._target_", "userpkg.good.Net").__name__ == "Net"
    assert locate("loss._target_", "torch.nn.functional.mse_loss") is torch.nn.functional.mse_loss
    assert locate("model._target_", "torch.nn.Linear.forward") is torch.nn.Linear.forward


@pytest.mark.parametrize(
    "path,expected",
    [
        (
            "nopkg_xyz.models.Net",
            "model._target_='nopkg_xyz.models.Net': cannot import it (No module named 'nopkg_xyz'; "
            "is its directory on PYTHONPATH?)",
        ),
        ("userpkg.good.Nett", "model._target_='userpkg.good.Nett': module userpkg.good has no attribute 'Nett'"),
        ("userpkg.nomodule.Net", "model._target_='userpkg.nomodule.Net': module userpkg has no attribute 'nomodule'"),
        (
            "userpkg.needs_missing.Net",
            "model._target_='userpkg.needs_missing.Net': importing userpkg.needs_missing failed: "
            "No module named 'a_module_that_is_not_installed_xyz'",
        ),
        ("userpkg.good.SCALE", "model._target_='userpkg.good.SCALE': expected a class or function, got a int"),
        ("Net", "model._target_='Net': expected a dotted path to a class or function, such as my_pkg.models.Net"),
    ],
)
def test_locate_refuses_in_one_line_naming_the_setting(user_package, path, expected):
    with pytest.raises(ConfigError) as caught:
        locate("model._target_", path)
    assert _one_line(caught) == expected


def test_locate_reports_a_module_that_does_not_parse(user_package):
    with pytest.raises(ConfigError) as caught:
        locate("data._target_", "userpkg.bad_syntax.make")
    assert _one_line(caught).startswith(
        "data._target_='userpkg.bad_syntax.make': importing userpkg.bad_syntax failed: SyntaxError"
    )


def test_build_passes_only_offered_arguments_the_target_names(user_package):
    offered = {"in_features": 5, "num_classes": 3, "vocab_size": 99, "width": 7}
    net = build("model", {"name": "custom", "_target_": "userpkg.good.Net"}, offered)
    assert net.args == (5, 3, 7)
    # The config wins over an offered value; unknown (None) offers are not passed.
    net = build(
        "model",
        {"name": "custom", "_target_": "userpkg.good.Net", "num_classes": 4, "width": 2},
        {"in_features": 5, "num_classes": 3, "width": None},
    )
    assert net.args == (5, 4, 2)
    # A target without named parameters (**kwargs) gets its settings only.
    assert build("data", {"name": "custom", "_target_": "userpkg.good.loose", "n": 3}, {"in_features": 1}) == {"n": 3}


def test_build_instantiates_nested_targets(user_package):
    seq = build(
        "model",
        {
            "name": "custom",
            "_target_": "torch.nn.Sequential",
            "_args_": [{"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3}],
        },
    )
    assert isinstance(seq[0], torch.nn.Linear) and seq[0].out_features == 3


def test_build_refuses_rejected_arguments_naming_the_node(user_package):
    with pytest.raises(ConfigError) as caught:
        build(
            "model",
            {"name": "custom", "_target_": "userpkg.good.Net", "depth": 3},
            {"in_features": 5, "num_classes": 2},
        )
    assert _one_line(caught) == (
        "model._target_='userpkg.good.Net': Net.__init__() got an unexpected keyword argument "
        "'depth' (called with depth=3, in_features=5, num_classes=2)"
    )
    with pytest.raises(ConfigError) as caught:  # a built-in is named by its option
        build(
            "model",
            {"name": "mlp", "_target_": "fdp.model.builtin.MLP", "hidden": 4, "depth": -1},
            {"in_features": 5, "out_features": 2},
        )
    assert _one_line(caught) == "model=mlp: depth=-1: expected an integer >= 0"


def test_a_bug_inside_the_target_is_not_reported_as_a_config_error(user_package):
    with pytest.raises(AttributeError, match="missing_attribute"):
        build("model", {"name": "custom", "_target_": "userpkg.good.Broken"}, {"in_features": 5})
