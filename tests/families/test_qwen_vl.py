"""The qwen2_vl / qwen2_5_vl table entries: the language model with M-RoPE, and the tower
built from the same checkpoint, against transformers' whole model."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures.qwen_vision_models import (GRIDS, IMAGE_TOKEN, hf_vision_language_model, hf_vision_tower, image_prompt,
                                         random_pixel_values)

from mlx_tfm.errors import UserError
from mlx_tfm.families import model_args_from_config
from mlx_tfm.families.qwen_vl import qwen_vl_args, vision_tower_from_checkpoint, vision_weights
from mlx_tfm.loading import load_model
from mlx_tfm.model.mrope import batch_positions
from mlx_tfm.weights.files import read_checkpoint

STYLES = ["qwen2_vl", "qwen2_5_vl"]
PROMPT = image_prompt(GRIDS, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])


def saved(style: str, folder):
    hf_model = hf_vision_language_model(style)
    hf_model.save_pretrained(folder)
    return hf_model


@pytest.mark.parametrize("style", STYLES)
def test_the_checkpoint_tower_matches_transformers_image_features(style, tmp_path):
    hf_model = saved(style, tmp_path)
    pixel_values = random_pixel_values(GRIDS, hf_model.config.vision_config)
    with torch.no_grad():
        expected = torch.cat(hf_model.model.get_image_features(torch.from_numpy(pixel_values), torch.tensor(GRIDS))
                             .pooler_output).numpy()
    tower = vision_tower_from_checkpoint(*read_checkpoint(tmp_path))
    np.testing.assert_allclose(np.array(tower(mx.array(pixel_values), GRIDS)), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("style", STYLES)
def test_the_loaded_language_model_takes_the_image_positions(style, tmp_path):
    """load_model's text model on the prompt's M-RoPE positions == transformers' with
    the same embeddings and position ids (get_rope_index's)."""
    hf_model = saved(style, tmp_path)
    ids = torch.tensor([PROMPT])
    position_ids, _ = hf_model.model.get_rope_index(ids, (ids == IMAGE_TOKEN).int(), torch.tensor(GRIDS))
    with torch.no_grad():
        embeds = hf_model.model.get_input_embeddings()(ids)
        expected = hf_model(inputs_embeds=embeds, position_ids=position_ids).logits.numpy()
    model, _ = load_model(tmp_path)
    positions, _ = batch_positions([PROMPT], IMAGE_TOKEN, GRIDS, 2)
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT]), positions=positions)), expected, atol=1e-4,
                               rtol=1e-4)


def test_mlx_vlm_channels_last_patch_kernel_loads_the_same():
    hf_model = hf_vision_language_model("qwen2_5_vl")
    config = hf_model.config.to_dict()
    weights = {k: mx.array(v.numpy()) for k, v in hf_model.state_dict().items()}
    hf_tower = vision_tower_from_checkpoint(config, weights)
    kernel = weights.pop("model.visual.patch_embed.proj.weight")  # (D, C, T, P, P)
    mlx_vlm = {k.replace("model.visual.", "vision_tower."): v for k, v in weights.items()}
    mlx_vlm["vision_tower.patch_embed.proj.weight"] = mx.moveaxis(kernel, 1, -1)  # (D, T, P, P, C)
    assert sorted(vision_weights(mlx_vlm, hf_tower.args)) == sorted(vision_weights(weights, hf_tower.args)) + [
        "patch_embed.proj.weight"]
    tower = vision_tower_from_checkpoint(config, mlx_vlm)
    np.testing.assert_array_equal(np.array(tower.patch_embed.proj.weight), np.array(hf_tower.patch_embed.proj.weight))


def test_the_first_checkpoints_flat_config_reads_the_same():
    """Qwen2-VL's first hub configs: text keys at the top, rope_scaling of type mrope."""
    hf_model = hf_vision_language_model("qwen2_vl")
    config = hf_model.config.to_dict()
    text = config["text_config"]
    flat = {**{k: v for k, v in text.items() if k != "rope_parameters"}, "model_type": "qwen2_vl",
            "rope_theta": text["rope_parameters"]["rope_theta"], "vision_config": config["vision_config"],
            "rope_scaling": {"type": "mrope", "mrope_section": text["rope_parameters"]["mrope_section"]},
            "tie_word_embeddings": False,
            **{k: v for k, v in config.items() if k.endswith("_token_id")}}  # as the hub's first configs have them
    assert model_args_from_config(flat) == model_args_from_config(config)
    assert qwen_vl_args(config)["rope_scaling"] == {"rope_type": "mrope", "mrope_section": [2, 3, 3]}


def test_tower_errors_are_one_line():
    hf_model = hf_vision_language_model("qwen2_vl")
    config = hf_model.config.to_dict()
    weights = {k: mx.array(v.numpy()) for k, v in hf_model.state_dict().items()}
    with pytest.raises(UserError, match="model_type 'qwen2' has no Qwen vision tower"):
        vision_tower_from_checkpoint({**config, "model_type": "qwen2"}, weights)
    with pytest.raises(UserError, match="has no vision_config"):
        vision_tower_from_checkpoint({"model_type": "qwen2_vl"}, weights)
    del weights["model.visual.merger.ln_q.bias"]
    with pytest.raises(UserError, match=r"missing \['merger.ln_q.bias'\], unexpected \[\]"):
        vision_tower_from_checkpoint(config, weights)
    weights["model.visual.merger.ln_q.bias"] = mx.zeros((5,))
    with pytest.raises(UserError, match=r"merger.ln_q.bias is \(5,\), expected \(32,\)"):
        vision_tower_from_checkpoint(config, weights)


def test_the_tower_reads_hugging_face_activation_names():
    """Qwen2.5-VL's MLP takes the config's hidden_act; transformers' names map onto ours."""
    hf_tower, vision_config = hf_vision_tower("qwen2_5_vl", hidden_act="gelu_pytorch_tanh")
    config = {"model_type": "qwen2_5_vl", "vision_config": vision_config.to_dict()}
    tower = vision_tower_from_checkpoint(config, {f"visual.{k}": mx.array(v.numpy())
                                                  for k, v in hf_tower.state_dict().items()})
    pixel_values = random_pixel_values(GRIDS, vision_config)
    with torch.no_grad():
        expected = hf_tower(torch.from_numpy(pixel_values), grid_thw=torch.tensor(GRIDS)).pooler_output.numpy()
    np.testing.assert_allclose(np.array(tower(mx.array(pixel_values), GRIDS)), expected, atol=1e-4, rtol=1e-4)
