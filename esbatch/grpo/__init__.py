"""GRPO: the group-relative policy-gradient objective (paper Sec. 2.2) and the ES/GRPO FLOP accounting (App. G.2)."""
