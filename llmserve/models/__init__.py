from llmserve.config import ModelConfig
from llmserve.models.gemma3 import Gemma3ForCausalLM
from llmserve.models.llama import LlamaForCausalLM

# Llama, Mistral, Qwen2 (QKV bias), Qwen3 (q/k RMSNorm) and Phi-3 (partial rotary) share one decoder; the config's flags differ. Gemma 3 has
# its own layer around the same attention.
MODEL_REGISTRY = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM,
                  "phi3": LlamaForCausalLM, "gemma3": Gemma3ForCausalLM}


def build_model(config: ModelConfig, lm_head: bool = True):
    """lm_head=False: the model of an embedding engine (--runner pooling), without its LM head."""
    return MODEL_REGISTRY[config.architecture](config, lm_head=lm_head)
