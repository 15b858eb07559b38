"""`llmserve gateway`: routing, fallbacks, parameter policy, tiers, a response cache and cost over many backends."""
