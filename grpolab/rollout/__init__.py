"""Sampling answers and scoring them under the policy and the reference: the Backend protocol,
the decode loop, the scoring pass, and the model stacks (Hugging Face, vLLM, the fast paths)."""
