"""Opting in to contrib from a command line: ``--set contrib=[MODULE]`` registers the module's
names before the command checks the user's; without it, a contrib name is refused in one line
that names the module and the flag."""

from __future__ import annotations

import argparse

import pytest

from cals_seg.calibrators import CALIBRATORS
from cals_seg.commands._cli import enable_set_contrib, registered_or_refused
from cals_seg.commands.eval_seg import calibrator_name
from cals_seg.errors import UserError
from cals_seg.utils.registry import contrib_modules


def test_every_name_kept_beside_the_core_names_a_contrib_module():
    from cals_seg.losses.registry import LOSSES, MARGIN_RULES

    for registry in (CALIBRATORS, LOSSES, MARGIN_RULES):
        assert set(registry.beside.values()) <= set(contrib_modules())


@pytest.mark.parametrize("name", sorted(CALIBRATORS.beside))
def test_a_contrib_calibrator_is_refused_naming_the_opt_in_then_accepted(name):
    module = CALIBRATORS.beside[name]
    assert calibrator_name(name) == name  # the parser defers to the check after --set
    if name not in CALIBRATORS:  # not yet imported by another test of this process
        with pytest.raises(UserError, match=rf"--set contrib=\[{module}\]") as err:
            registered_or_refused(CALIBRATORS, [name], "--calibrators")
        assert "\n" not in str(err.value)
    assert enable_set_contrib(["eval.n_bins=15", f"contrib=[{module}]"]) == [module]
    registered_or_refused(CALIBRATORS, [name], "--calibrators")
    assert name in CALIBRATORS


@pytest.mark.parametrize("item", ["contrib=nope", "contrib=[nope]", "contrib=[1]",
                                  "contrib={a: 1}"])
def test_a_bad_contrib_item_is_one_line(item):
    with pytest.raises(UserError) as err:
        enable_set_contrib([item])
    assert "\n" not in str(err.value) and "contrib" in str(err.value)


def test_unknown_names_stay_refused():
    with pytest.raises(argparse.ArgumentTypeError, match="valid names"):
        calibrator_name("tz")
    with pytest.raises(UserError, match="valid names"):
        registered_or_refused(CALIBRATORS, ["tz"], "--calibrators")
