"""``dspark-core simulate --rows external --device-step``: the loop driven by the device step
(``Stager.step_many``) is lossless and makes exactly the host path's rounds, acceptance,
rebases, failures and buffered rows, without a host synchronisation per step; for a chain
drafter (``--drafter eagle3``) too, its ids travelling in the slot token table."""

from __future__ import annotations

import json

import pytest

from dspark_core.cli import main
from dspark_core.cli.simulate import simulate

SMALL = dict(context=500, generate=240, window=48, block=4, feature_dim=64, rows="external", ring="host")
SAME = ("lossless", "acceptance", "drafter_rounds", "failures", "skips", "rebases", "restaged_rows", "peak_rows",
        "generated_tokens", "max_drafter_pos", "verified_rounds", "accepted_histogram", "metrics_match")


@pytest.mark.parametrize("drafter", ["dspark", "eagle3"])
@pytest.mark.parametrize("stager,seqs,fail_every", [("core", 1, 0), ("core", 3, 6), ("reference", 2, 5)])
def test_device_step_loop_equals_the_host_path(stager, seqs, fail_every, drafter):
    host = simulate(**SMALL, stager=stager, seqs=seqs, fail_every=fail_every, drafter=drafter)
    dev = simulate(**SMALL, stager=stager, seqs=seqs, fail_every=fail_every, device_step=True, drafter=drafter)
    assert dev["lossless"] and host["lossless"]
    # The windowed drafter drafts well (a chain drafter reading wrong ids would not), the
    # absolute one collapses past its trained range.
    assert host["modes"]["windowed"]["acceptance"] > 0.3
    for mode, h in host["modes"].items():
        d = dev["modes"][mode]
        assert {k: d[k] for k in SAME} == {k: h[k] for k in SAME}, mode
        assert h["host_syncs_per_step"] == 1.0
        # Hand-backs only for drafter failures (none without them).
        assert d["host_syncs_per_step"] <= (1.0 if fail_every else 0.0)
        if not fail_every:
            assert d["host_syncs_per_step"] == 0.0


def test_cli_flag_and_json(capsys):
    assert main(["simulate", "--rows", "external", "--ring", "host", "--device-step", "--context", "300",
                 "--generate", "100", "--window", "40", "--block", "4", "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["device_step"] is True and out["lossless"]
    assert all(m["host_syncs_per_step"] == 0.0 for m in out["modes"].values())
    assert main(["simulate", "--device-step", "--context", "100", "--generate", "10", "-q"]) == 2  # held rows
    assert main(["simulate", "--rows", "external", "--ring", "host", "--device-step", "--drafter", "eagle3",
                 "--context", "300", "--generate", "100", "--window", "40", "--block", "4", "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["drafter"] == "eagle3" and out["lossless"]
    assert all(m["host_syncs_per_step"] == 0.0 for m in out["modes"].values())


def test_the_text_output_says_the_device_step_ran(capsys):
    assert main(["simulate", "--rows", "external", "--ring", "host", "--device-step", "--context", "300",
                 "--generate", "60", "--window", "40", "--block", "4"]) == 0
    text = capsys.readouterr().out
    assert "on the device step (step_many: one call per step)" in text.splitlines()[0]
    assert any(line.startswith("host waits per server step") for line in text.splitlines())
    assert main(["simulate", "--rows", "external", "--ring", "host", "--context", "300",
                 "--generate", "60", "--window", "40", "--block", "4"]) == 0
    assert "device step" not in capsys.readouterr().out.splitlines()[0]
