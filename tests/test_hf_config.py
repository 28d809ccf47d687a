"""Drafter metadata from a Hugging Face config.json (dspark_core.gguf.hf_config).

The configs below carry the keys the published drafters carry (values of the
same shape: an EAGLE-3 head for an 8B Llama trained on 2,048 positions, a
DFlash drafter for a Qwen3 target, a DeepSeek-V3-style MTP head); each test
says which key a value must come from.
"""

from __future__ import annotations

import json
import logging

import pytest

from dspark_core import ConfigError, plan_context
from dspark_core.cli import main
from dspark_core.gguf.drafter_info import DrafterInfo, DrafterMetadataError

EAGLE3 = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
          "num_hidden_layers": 1, "max_position_embeddings": 2048, "draft_vocab_size": 32000}
DFLASH = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 2560,
          "max_position_embeddings": 40960,
          "dflash_config": {"block_size": 16, "target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669}}
MTP = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
       "max_position_embeddings": 163840, "num_nextn_predict_layers": 1}


def _write(tmp_path, data, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return p


def test_eagle3_is_a_chain_drafter_whose_block_size_is_the_servers(tmp_path):
    _write(tmp_path, {**EAGLE3, "eagle_aux_hidden_state_layer_ids": [1, 15, 28]})
    info = DrafterInfo.from_hf_config(tmp_path, block_size=5)  # the directory finds its config.json
    assert info.kind == "chain" and info.architecture == "LlamaForCausalLMEagle3"
    assert info.block_size == 5 and info.sources["block_size"] == "override"
    assert info.n_ctx_train == 2048 and info.n_ctx_train_source == "max_position_embeddings"
    assert info.target_layers == (1, 15, 28) and info.sources["target_layers"] == "eagle_aux_hidden_state_layer_ids"
    assert info.feature_dim == 3 * 4096 and info.embedding_length == 4096
    with pytest.raises(DrafterMetadataError, match="EAGLE-3 is a chain drafter.*pass block_size="):
        DrafterInfo.from_hf_config(tmp_path)


def test_eagle3_without_layer_ids_reads_its_three_taps_of_the_target_width(tmp_path):
    p = _write(tmp_path, {**EAGLE3, "target_hidden_size": 5120})
    info = DrafterInfo.from_hf_config(p, block_size=4)
    assert info.target_layers == () and info.feature_dim == 3 * 5120
    assert info.feature_dim_source == "3 taps (eagle3) * target_hidden_size"


@pytest.mark.parametrize("data,family", [({"model_type": "eagle", "hidden_size": 4096, "max_position_embeddings": 2048},
                                          "eagle"), (MTP, "mtp")])
def test_eagle_and_mtp_read_one_tap(tmp_path, data, family):
    info = DrafterInfo.from_hf_config(_write(tmp_path, data), block_size=3)
    assert info.kind == "chain" and info.feature_dim == data["hidden_size"]
    assert info.feature_dim_source == f"1 taps ({family}) * hidden_size"


def test_mtp_inheriting_the_targets_context_warns(tmp_path, caplog):
    p = _write(tmp_path, MTP)
    with caplog.at_level(logging.WARNING, logger="dspark_core"):
        info = DrafterInfo.from_hf_config(p, block_size=1, target_n_ctx=163840)
    assert len(info.warnings) == 1 and "looks inherited" in info.warnings[0]
    assert "looks inherited" in caplog.text
    assert DrafterInfo.from_hf_config(p, block_size=1, target_n_ctx=32768).warnings == ()
    assert DrafterInfo.from_hf_config(p, block_size=1, target_n_ctx=163840, n_ctx_train=4096).warnings == ()


def test_dflash_is_a_block_drafter_with_its_own_block_and_layers(tmp_path):
    p = _write(tmp_path, DFLASH)
    info = DrafterInfo.from_hf_config(p)
    assert info.kind == "block" and info.block_size == 16 and info.sources["block_size"] == "dflash_config.block_size"
    assert info.target_layers == (1, 9, 17, 25, 33) and info.feature_dim == 5 * 2560
    assert info.mask_token_id == 151669 and info.sources["mask_token_id"] == "dflash_config.mask_token_id"
    assert DrafterInfo.from_hf_config(p, block_size=8).block_size == 8  # the caller's wins
    assert DrafterInfo.from_hf_config(p, n_ctx_train=4096).n_ctx_train_source == "override"
    # The plan of a config.json drafter is a GGUF drafter's: the window is min(n_ctx_train, n_batch).
    plan = plan_context(DrafterInfo.from_hf_config(p, n_ctx_train=4096), None, 2048, storage="q8_0")
    assert plan.window == 2048


def test_a_block_config_decides_before_the_names_and_an_eagle_key(tmp_path):
    """A DFlash config carrying eagle_aux_hidden_state_layer_ids too (for engines that read only
    that key) is a block drafter; a model_type names the family when the architecture does not."""
    info = DrafterInfo.from_hf_config(_write(tmp_path, {**DFLASH, "eagle_aux_hidden_state_layer_ids": [2, 10]}))
    assert info.kind == "block" and info.target_layers == (1, 9, 17, 25, 33)  # its own key, as stored
    data = {"architectures": ["Qwen3Model"], "model_type": "dspark", "hidden_size": 1024,
            "max_position_embeddings": 4096, "block_size": 8, "target_layer_ids": []}
    info = DrafterInfo.from_hf_config(_write(tmp_path, data))
    assert info.kind == "block" and info.block_size == 8 and info.sources["block_size"] == "block_size"
    assert info.target_layers == () and "target_layers" not in info.sources and info.feature_dim is None


def test_a_block_drafter_without_a_block_size_says_so(tmp_path):
    data = {**DFLASH, "dflash_config": {"target_layer_ids": [1, 2]}}
    with pytest.raises(DrafterMetadataError, match="missing block_size"):
        DrafterInfo.from_hf_config(_write(tmp_path, data))
    assert DrafterInfo.from_hf_config(tmp_path, block_size=4).block_size == 4


@pytest.mark.parametrize("data,match", [
    ({**EAGLE3, "max_position_embeddings": None}, "trained range is unknown.*n_ctx_train="),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "max_position_embeddings": 8192},
     "not a drafter this package knows"),
    ({**EAGLE3, "max_position_embeddings": "2048"}, "max_position_embeddings must be an integer"),
    ({**EAGLE3, "max_position_embeddings": True}, "max_position_embeddings must be an integer"),
    ({**EAGLE3, "eagle_aux_hidden_state_layer_ids": ["1"]}, "eagle_aux_hidden_state_layer_ids must be a list"),
    ({**EAGLE3, "max_position_embeddings": 8}, r"n_ctx_train \(8, from max_position_embeddings\) must be greater"),
    ({**MTP, "num_nextn_predict_layers": -1}, "num_nextn_predict_layers must be an integer >= 0"),
    ({**EAGLE3, "hidden_size": True, "target_hidden_size": 4096}, "hidden_size must be an integer"),
    ({**EAGLE3, "architectures": ["LlamaForCausalLM"], "eagle_aux_hidden_state_layer_ids": None}, "not a drafter"),
    ([1, 2], "holds a JSON object, got list"),
    ("{not json", "not a JSON config"),
])
def test_bad_configs_are_errors_that_name_the_file(tmp_path, data, match):
    p = _write(tmp_path, data)
    with pytest.raises(DrafterMetadataError, match=match) as e:
        DrafterInfo.from_hf_config(p, block_size=4)
    assert e.value.path == str(p)


def test_missing_files_and_bad_arguments(tmp_path):
    with pytest.raises(DrafterMetadataError, match="cannot read the file"):
        DrafterInfo.from_hf_config(tmp_path)  # a directory without a config.json
    p = _write(tmp_path, EAGLE3)
    with pytest.raises(ConfigError, match="block_size"):
        DrafterInfo.from_hf_config(p, block_size=0)
    with pytest.raises(ConfigError, match="n_ctx_train"):
        DrafterInfo.from_hf_config(p, block_size=2, n_ctx_train=-5)


def test_inspect_reads_a_config_json(tmp_path, capsys):
    _write(tmp_path, {**EAGLE3, "eagle_aux_hidden_state_layer_ids": [1, 15, 28]})
    assert main(["inspect", str(tmp_path), "--block-size", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["drafter"]["kind"] == "chain" and out["drafter"]["target_layers"] == [1, 15, 28]
    assert out["plan"]["window"] == 2048
    assert main(["inspect", str(tmp_path / "config.json")]) == 2
    assert "pass block_size=" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "drafter.gguf"), "--block-size", "4"]) == 2
    assert "--block-size is for a config.json" in capsys.readouterr().err
