"""The SLO file: validated with a sentence per problem, rendered deterministically, kept in sync.

A threshold that is not a bucket edge of the proxy's histograms is refused by `slo render`
and `slo check` (exit 2): the SLI `bucket{le="T"} / count` needs an edge at exactly T.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from phasewatch.cli import main
from phasewatch.core.metrics import ITL_BUCKETS, TTFT_BUCKETS
from phasewatch.core.settings import Settings
from phasewatch.slo.files import default_spec_text, load_spec, render_files
from phasewatch.slo.rules import QUIET_VERDICTS, VERDICTS, burn_record, errors_record, render_groups
from phasewatch.slo.spec import SLO_NAMES, SloError, parse_spec
from tests.ops.conftest import DEPLOY, SLO_FILE


def base() -> dict[str, Any]:
    data = yaml.safe_load(SLO_FILE.read_text())
    assert isinstance(data, dict)
    return data


def rules_by_record(data: dict[str, Any]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for group in render_groups(parse_spec(data)):
        for rule in group["rules"]:
            if "record" in rule:
                found.setdefault(rule["record"], []).append(rule["expr"])
    return found


def test_committed_rules_are_what_the_slo_file_renders(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slo", "check", "--file", str(SLO_FILE)]) == 0
    assert "up to date" in capsys.readouterr().out


def test_committed_thresholds_match_the_proxy_defaults() -> None:
    """The deployments leave PHASEWATCH_SLO_* alone or set them to these: both are edges."""
    spec = load_spec(SLO_FILE)
    defaults = Settings()
    assert spec.default.ttft.threshold_s in TTFT_BUCKETS and defaults.slo_ttft_s in TTFT_BUCKETS
    assert spec.default.itl.threshold_s in ITL_BUCKETS and defaults.slo_itl_s in ITL_BUCKETS


@pytest.mark.parametrize(("slo", "value", "nearest"),
                         [("ttft", 0.45, "0.4 and 0.5"), ("itl", 0.042, "0.04 and 0.05"),
                          ("ttft", 900.0, "300")])
def test_a_threshold_off_the_bucket_edges_is_refused(slo: str, value: float,
                                                     nearest: str) -> None:
    data = base()
    data["objectives"][slo]["threshold_s"] = value
    with pytest.raises(SloError, match=rf"objectives\.{slo}\.threshold_s {value:g} is not a "
                                       rf"bucket edge.*nearest edges are {nearest}"):
        parse_spec(data)


def test_slo_render_refuses_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = base()
    data["models"] = [{"model": "big", "itl": {"threshold_s": 0.045}}]
    slo_file = tmp_path / "slo.yaml"
    slo_file.write_text(yaml.safe_dump(data))
    assert main(["slo", "render", "--file", str(slo_file)]) == 2
    error = capsys.readouterr().err
    assert f"{slo_file}: models.0.itl.threshold_s 0.045 is not a bucket edge" in error
    assert "ITL_BUCKETS in phasewatch.core.metrics" in error
    assert main(["slo", "check", "--file", str(slo_file)]) == 2
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["slo.yaml"]


@pytest.mark.parametrize(("change", "says"), [
    ({"objective": 0.9}, "the 14.4x page could never fire"),
    ({"objective": 1.0}, "less than 1"),
    ({"threshold_s": 0}, "greater than 0"),
    ({"treshold_s": 0.5}, "objectives.ttft.treshold_s: Extra inputs are not permitted"),
])
def test_bad_objectives_are_refused_with_a_sentence(change: dict[str, Any], says: str) -> None:
    data = base()
    data["objectives"]["ttft"].update(change)
    with pytest.raises(SloError, match=says.replace(".", r"\.")):
        parse_spec(data)


def test_check_fails_on_a_stale_rule_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slo_file = tmp_path / "slo.yaml"
    shutil.copy(SLO_FILE, slo_file)
    assert main(["slo", "render", "--file", str(slo_file)]) == 0
    assert main(["slo", "check", "--file", str(slo_file)]) == 0
    data = base()
    data["objectives"]["itl"]["objective"] = 0.99
    slo_file.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    assert main(["slo", "check", "--file", str(slo_file)]) == 1
    assert "not up to date" in capsys.readouterr().err
    assert main(["slo", "render", "--file", str(slo_file)]) == 0
    assert main(["slo", "check", "--file", str(slo_file)]) == 0


def test_every_window_has_an_error_ratio_and_a_burn_rate_per_slo() -> None:
    records = rules_by_record(base())
    for slo in SLO_NAMES:
        for window in ("5m", "30m", "1h", "2h", "6h", "1d", "3d"):
            assert f"[{window}]" in records[errors_record(slo, window)][0]
            assert records[burn_record(slo, window)] == [f"{errors_record(slo, window)} / 0.05"]


def test_a_model_override_gets_its_own_threshold_and_budget() -> None:
    data = base()
    data["models"] = [{"model": "Qwen/Qwen2.5-7B", "ttft": {"threshold_s": 1.0,
                                                            "objective": 0.99}}]
    records = rules_by_record(data)
    default, override = records[errors_record("ttft", "1h")]
    assert 'le="0.5", model!~"Qwen/Qwen2\\\\.5\\\\-7B"' in default
    assert 'le="1.0", model="Qwen/Qwen2.5-7B"' in override
    assert records[burn_record("ttft", "1h")] == [
        'phasewatch:ttft_slo_errors:ratio_rate1h{model!~"Qwen/Qwen2\\\\.5\\\\-7B"} / 0.05',
        'phasewatch:ttft_slo_errors:ratio_rate1h{model="Qwen/Qwen2.5-7B"} / 0.01',
    ]
    # ITL was not overridden: the model keeps the default ITL objective, in its own rule.
    assert len(records[errors_record("itl", "1h")]) == 2


def test_rendering_is_deterministic() -> None:
    spec = load_spec(SLO_FILE)
    first = render_files(spec, SLO_FILE)
    assert [f.text for f in first] == [f.text for f in render_files(spec, SLO_FILE)]
    assert {f.path for f in first} == {DEPLOY / "rules" / "phasewatch-slo.rules.yml",
                                      DEPLOY / "k8s" / "prometheusrule.yaml"}


def test_diagnosis_alerts_cover_the_diagnosis_verdicts() -> None:
    """One alert rule per verdict that means trouble; the quiet ones have none."""
    from phasewatch.diagnosis.verdicts import Verdict

    assert set(VERDICTS) | set(QUIET_VERDICTS) == {verdict.value for verdict in Verdict}
    assert not set(VERDICTS) & set(QUIET_VERDICTS)


def test_the_packaged_default_is_the_repositorys_slo_file() -> None:
    assert default_spec_text() == SLO_FILE.read_text()


def test_without_an_slo_file_render_says_what_to_do_and_init_writes_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # no deploy/slo.yaml here, as for an installed phasewatch
    assert main(["slo", "render"]) == 2
    assert "slo init --file deploy/slo.yaml" in capsys.readouterr().err
    assert main(["slo", "init", "--file", "slo.yaml"]) == 0
    assert (tmp_path / "slo.yaml").read_text() == SLO_FILE.read_text()
    assert main(["slo", "init", "--file", "slo.yaml"]) == 2  # never overwritten
    assert main(["slo", "render", "--file", "slo.yaml"]) == 0
    rendered = (tmp_path / "rules" / "phasewatch-slo.rules.yml").read_text()
    assert rendered == (DEPLOY / "rules" / "phasewatch-slo.rules.yml").read_text()
