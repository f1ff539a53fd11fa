"""The families we know of but do not build yet, each with what is missing, and which
model_types are hybrids (recurrent layers beside attention). ``coverage.py`` builds the
family table from these; an unknown ``model_type`` error quotes the line."""

from __future__ import annotations

KINDS = ("dense", "MoE", "hybrid", "encoder", "encoder-decoder")

# Layers that keep a recurrent state (linear attention, SSMs, short convolutions) beside or
# instead of attention: the table's "hybrid", whoever builds them.
HYBRIDS = frozenset((
    "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "lfm2-vl",
    "lfm3", "mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "bamba", "zamba", "zamba2", "nemotron_h",
    "granitemoehybrid", "minimax", "kimi_linear", "recurrent_gemma", "rwkv", "rwkv7", "xlstm", "plamo2",
    "bailing_moe_linear", "bailing_hybrid", "olmo_hybrid", "qwen4_exp", "qwen4_exp_text", "lara_mini", "zaya",
    "dory", "hrm_text", "prism_hadamard_qwen35",
))
ENCODER_DECODERS = frozenset(("t5", "mt5"))

DECODER_OF_SEQ2SEQ = "the decoder half of an encoder-decoder (cross-attention into another model's encoder)"
ENCODER_AS_DECODER = "an encoder checkpoint run causally (transformers' *ForCausalLM of a BERT-like model)"
IMAGE_TEXT = "an image/audio-text model: its text tower's loading is not written"
REMOTE_CODE = "not in transformers (remote code): no reference implementation to test against"
UNREVIEWED = "not reviewed yet"

# model_type -> (kind, what is missing) for every type in mlx-lm or transformers we do not build.
NOT_YET: dict[str, tuple[str, str]] = {
    "falcon_mamba": ("hybrid", "Mamba-1 with normed B, C and dt (refused by name)"),
    # still to do
    "olmo": ("dense", "LayerNorm without weight or bias; mlx-lm's olmo reads hf_olmo's format, not transformers'"),
    "hunyuan": ("MoE", "mlx-lm's own layout of HunYuan MoE (cross-layer attention)"),
    # not in transformers
    **dict.fromkeys(("internlm2", "baichuan_m1", "afm7", "gear", "iquestloopcoder", "lille-130m", "mimo", "minicpm",
                     "muse_glimmer", "muse_spark", "nanbeige", "nemotron-nas", "openelm", "phi-msft", "phi3small",
                     "plamo", "plamo3", "qwen", "spark2_5", "talkie", "telechat3", "xverse", "youtu_llm"),
                    ("dense", REMOTE_CODE)),
    **dict.fromkeys(("bailing_moe", "bailing_moe_v3", "deepseek", "deepseek_v41", "deepseek_v41_text", "Klear",
                     "joyai_llm_flash", "kimi_k2", "kimi_k25", "kimi_k3", "longcat_flash_ngram", "mistral4", "phixtral",
                     "step3p5"), ("MoE", REMOTE_CODE)),
    **dict.fromkeys(("bailing_moe_linear", "plamo2", "rwkv7"), ("hybrid", REMOTE_CODE)),
    # decoders of encoder-decoders, encoders run causally
    **dict.fromkeys(("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
                     "plbart", "prophetnet", "trocr", "whisper", "moss_transcribe_diarize"),
                    ("encoder-decoder", DECODER_OF_SEQ2SEQ)),
    **dict.fromkeys(("bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
                     "rembert", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta-xl", "xmod", "xlm",
                     "xlnet", "reformer"), ("encoder", ENCODER_AS_DECODER)),
    # image-text and audio-text models
    **dict.fromkeys(("emu3", "fuyu", "git", "got_ocr2", "mllama", "phi4_multimodal", "gemma3n", "gemma4_unified",
                     "kimi_vl", "pixtral",
                     "minimax_m3_vl", "minimax_m3_vl_text", "lfm2-vl", "moshi", "musicgen", "musicgen_melody",
                     "dots3_note", "dots3_note_text", "aria_text", "cohere_compass_text"), ("dense", IMAGE_TEXT)),
    # dense decoders
    "bloom": ("dense", "ALiBi positions"), "mpt": ("dense", "ALiBi positions"),
    "falcon": ("dense", "parallel attention with its own fused QKV layout, ALiBi in some checkpoints"),
    "gpt_neo": ("dense", "local attention layers without the 1/sqrt(head_dim) scale"),
    "codegen": ("dense", "GPT-J's block with CodeGen's fused qkv order"),
    "gpt_neox_japanese": ("dense", "its own fused attention layout and biases"),
    "openai-gpt": ("dense", "post-norm GPT-1 (no final norm); its table entry"),
    "ctrl": ("dense", "sinusoidal positions scaled embeddings; its table entry"),
    "xglm": ("dense", "sinusoidal positions offset by 2; its table entry"),
    "cpmant": ("dense", "relative position buckets in a decoder"),
    "persimmon": ("dense", "q/k LayerNorm with partial RoPE and squared ReLU; its table entry"),
    "diffllama": ("dense", "differential attention (two softmaxes subtracted)"),
    "doge": ("MoE", "dynamic mask attention and cross-domain experts"),
    "gpt-sw3": ("dense", "an alias in transformers' table: its configs say gpt2, which is built"),
    "nanochat": ("dense", "its table entry (ReLU^2, q/k norm without weights)"),
    "jais2": ("dense", UNREVIEWED), "hyperclovax": ("dense", UNREVIEWED), "youtu": ("dense", UNREVIEWED),
    "apertus1p5_text": ("dense", UNREVIEWED), "granite_swa": ("dense", UNREVIEWED), "blt": ("dense", UNREVIEWED),
    "inkling_text": ("dense", UNREVIEWED), "inkling2_text": ("dense", UNREVIEWED),
    "inkling2_loop_text": ("dense", UNREVIEWED), "gemma4_assistant": ("dense", UNREVIEWED),
    "gemma4_unified_assistant": ("dense", UNREVIEWED), "gemma4_unified_text": ("dense", UNREVIEWED),
    "gemma3n_text": ("dense", "per-layer embeddings, AltUp and LAuReL blocks"),
    "bitnet": ("dense", "ternary (1.58-bit) weights with activation quantization"),
    "minicpm3": ("dense", "multi-head latent attention (DeepSeek-V2's MLA)"),
    "modernbert-decoder": ("dense", "its table entry (ModernBERT's block, causal)"),
    # mixtures of experts
    "dbrx": ("MoE", "its fused Wqkv and experts layout"),
    "jetmoe": ("MoE", "mixture of attention heads (experts in attention too)"),
    "granitemoe_swa": ("MoE", UNREVIEWED),
    "afmoe": ("MoE", "gated attention, mu-P scaling and its sigmoid router"),
    "cohere2_moe": ("MoE", UNREVIEWED), "mellum": ("MoE", UNREVIEWED), "laguna": ("MoE", UNREVIEWED),
    "solar_open": ("MoE", UNREVIEWED), "axk1": ("MoE", UNREVIEWED), "axk2": ("MoE", UNREVIEWED),
    "beam": ("MoE", UNREVIEWED), "flint": ("MoE", UNREVIEWED), "kolibri1": ("MoE", UNREVIEWED),
    "hy_v3": ("MoE", UNREVIEWED), "hy_v4": ("MoE", UNREVIEWED),
    "sarvam_mla": ("MoE", "multi-head latent attention (DeepSeek-V3's)"),
    "deepseek_v32": ("MoE", "DeepSeek sparse attention (a lightning indexer) over MLA"),
    "deepseek_v4": ("MoE", "MLA with DeepSeek V4's compressed attention"),
    "glm_moe_dsa": ("MoE", "DeepSeek sparse attention"),
    "mimo_v2_flash": ("MoE", "hybrid sliding-window attention with attention sinks per layer type; its table entry"),
    "longcat_flash": ("MoE", "zero-computation experts and MLA"),
    # hybrids
    "jamba": ("hybrid", "Mamba layers between attention layers, experts"),
    "bamba": ("hybrid", "Mamba-2 layers between attention layers"),
    "zamba": ("hybrid", "Mamba layers with a shared attention block"),
    "zamba2": ("hybrid", "Mamba-2 layers with shared attention blocks"),
    "recurrent_gemma": ("hybrid", "RG-LRU recurrent blocks"),
    "rwkv": ("hybrid", "RWKV-4 time mixing (no attention)"),
    "xlstm": ("hybrid", "mLSTM blocks (no attention)"),
    "bailing_hybrid": ("hybrid", "linear attention layers with experts"),
    "olmo_hybrid": ("hybrid", "gated DeltaNet layers between attention layers"),
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text", "lara_mini", "zaya", "dory", "lfm3", "hrm_text",
                     "prism_hadamard_qwen35"), ("hybrid", UNREVIEWED)),
}
