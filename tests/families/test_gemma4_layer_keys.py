"""Gemma 4 configs of 10 layers or more: transformers 5 writes per_layer_config's keys
zero-padded ("05"), which name the same layers as unpadded ones."""

from transformers import Gemma4TextConfig

from mlx_tfm.families.gemma4 import gemma4_layer_types, global_layer_shape


def test_zero_padded_per_layer_keys_name_the_full_layers():
    layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    config = Gemma4TextConfig(num_hidden_layers=12, head_dim=32, global_head_dim=64, layer_types=layer_types).to_dict()
    assert "05" in config["per_layer_config"]  # what transformers writes
    shape = global_layer_shape(config, gemma4_layer_types(config))
    assert shape["global_head_dim"] == 64
