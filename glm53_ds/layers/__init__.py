"""GLM-5.3 modules in megatron layout (`[s, b, h]`), each in its own file."""
