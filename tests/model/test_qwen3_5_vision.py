"""Qwen3.5 with images (families/qwen3_5_vl.py): the hybrid language
model on interleaved M-RoPE over its partial rotary, Qwen3-VL's tower without DeepStack,
against transformers' Qwen3_5ForConditionalGeneration: logits, and the prompt read in
chunks then decoded token by token against transformers' one pass."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures.convert_helpers import TINY_CONFIGS
from fixtures.qwen_vision_models import (GRIDS, IMAGE_TOKEN, QWEN3_5_ROPE, QWEN3_5_STYLES, hf_qwen3_5_model,
                                         image_prompt, random_pixel_values)

from mlx_tfm.generation.images import ImageBoundModel
from mlx_tfm.loading import load_model
from mlx_tfm.model.vision_language import VisionLanguageModel

PROMPT = image_prompt(GRIDS, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])
ANSWER = [20, 21, 22, 23]
# A float32 run of the delta rule (chunked or step by step) lands up to about 2e-4 from the
# float64 logits on random models like these (test_hybrid_families.py allows Qwen3-Next 3e-4
# likewise; this one's forward lands 1.3e-4 away on one VM, 4.1e-4 on an AMD EPYC whose OpenBLAS
# runs its Haswell kernels); a wrong position is ~0.2 off.
DELTA_RULE_ATOL = 5e-4


@pytest.fixture(params=QWEN3_5_STYLES)
def qwen3_5_folder(request, tmp_path):
    hf_model = hf_qwen3_5_model(request.param)
    hf_model.save_pretrained(tmp_path / request.param)
    return tmp_path / request.param, hf_model


def hf_logits(hf_model, ids: list[int], pixel_values: np.ndarray) -> np.ndarray:
    """transformers' logits in float64: any float32 run of the delta rule drifts about 2e-4
    from them over these positions (tests/families/test_hybrid_families.py), ours too."""
    input_ids = torch.tensor([ids])
    if hf_model.config.text_config.model_type == "qwen3_5_moe_text":
        hf_model.set_experts_implementation("eager")  # the grouped products have no float64
    with torch.no_grad():
        return hf_model.double()(input_ids=input_ids, pixel_values=torch.from_numpy(pixel_values).double(),
                        image_grid_thw=torch.tensor(GRIDS), mm_token_type_ids=(input_ids == IMAGE_TOKEN).int()
                        ).logits[0].numpy()


def test_logits_and_cached_decoding_match_transformers(qwen3_5_folder):
    folder, hf_model = qwen3_5_folder
    pixel_values = random_pixel_values(GRIDS, hf_model.config.vision_config)
    expected = hf_logits(hf_model, PROMPT + ANSWER, pixel_values)
    model, _ = load_model(folder)
    assert isinstance(model, VisionLanguageModel)
    features = model.encode_images(mx.array(pixel_values), grid_thw=GRIDS)
    bound = ImageBoundModel(model, features, PROMPT, model.rope_positions(PROMPT, GRIDS))
    np.testing.assert_allclose(np.array(bound(mx.array([PROMPT + ANSWER]))[0]), expected, atol=DELTA_RULE_ATOL, rtol=0)
    cache, pieces = bound.make_cache(), []
    for start in range(0, len(PROMPT), 9):  # chunk edges inside both images
        pieces.append(np.array(bound(mx.array([PROMPT[start:start + 9]]), cache=cache)[0]))
    for token in ANSWER:
        pieces.append(np.array(bound(mx.array([[token]]), cache=cache)[0]))
    np.testing.assert_allclose(np.concatenate(pieces), expected, atol=DELTA_RULE_ATOL, rtol=0)


def test_published_sections_on_a_narrower_rotary_turn_as_transformers_turns_them():
    """A config without mrope_section takes Qwen3.5's (11, 11, 10), which overruns a rotary
    of fewer frequencies (here 8): transformers cuts the interleaved runs where the
    frequencies end, and so do we (each frequency's axis read off its rotary)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from mlx_tfm.model.mrope import frequency_axes

    config = Qwen3_5TextConfig(**{**TINY_CONFIGS["qwen3_5_text"], "head_dim": 32,
                                  "rope_parameters": {**QWEN3_5_ROPE, "mrope_section": [11, 11, 10]}})
    rotary = Qwen3_5TextRotaryEmbedding(config)
    base = torch.zeros(3, 1, 1, dtype=torch.long)
    _, sin0 = rotary(torch.zeros(1), base)
    n_frequencies = sin0.shape[-1] // 2
    assert n_frequencies == 8
    expected = np.zeros(n_frequencies, dtype=np.int64)
    for axis in (1, 2):
        moved = base.clone()
        moved[axis] = 7
        _, sin = rotary(torch.zeros(1), moved)
        expected[(sin - sin0)[0, 0, :n_frequencies].abs().numpy() > 1e-6] = axis
    np.testing.assert_array_equal(frequency_axes((11, 11, 10), interleaved=True, n_frequencies=8), expected)
