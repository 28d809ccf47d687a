"""The vLLM plugin's switch, without vLLM: importing dspark_core.vllm and calling its entry point
with the plugin off imports neither vLLM nor torch, and the package declares the entry point."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys


def test_entry_point_is_declared():
    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "dspark_core"]
    assert [ep.value for ep in eps] == ["dspark_core.vllm:register"]


def test_plugin_off_imports_neither_vllm_nor_torch():
    code = ("import os, sys; os.environ.pop('DSPARK_VLLM', None)\n"
            "import dspark_core.vllm as v\n"
            "assert not v.enabled(); v.register()\n"
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_switch_reads_exactly_one():
    code = ("import os; from dspark_core.vllm import enabled, ENABLE_ENV\n"
            "res = []\n"
            "for value in ('1', ' 1 ', '0', 'true', ''):\n"
            "    os.environ[ENABLE_ENV] = value; res.append(enabled())\n"
            "print(res)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[True, True, False, False, False]"
