"""The model: the GPT (dense and MoE), its mixture-of-experts layer and the token stream."""
