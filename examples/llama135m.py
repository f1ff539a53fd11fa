"""The 135M-class Llama shape every benchmark here uses (SmolLM-135M's: hidden 576,
30 layers, 9 heads, 3 KV heads, d_ff 1536, vocab 49152, tied embeddings), as a Hugging
Face config. Random weights are fine for speed and memory; only the shape matters."""

LLAMA_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}
