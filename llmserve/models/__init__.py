from llmserve.config import ModelConfig
from llmserve.models.gemma import GemmaForCausalLM
from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.olmo2 import Olmo2ForCausalLM

# Llama, Mistral, Qwen2 (QKV bias), Qwen3 (q/k RMSNorm), Phi-3 (partial rotary) and SmolLM3 (NoPE layers) share one
# decoder; the config's flags differ. Gemma 1, 2 and 3 and OLMo 2 and 3 have their own layers around the same attention.
MODEL_REGISTRY = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM,
                  "phi3": LlamaForCausalLM, "smollm3": LlamaForCausalLM, "gemma": GemmaForCausalLM,
                  "gemma2": GemmaForCausalLM, "gemma3": GemmaForCausalLM, "olmo2": Olmo2ForCausalLM,
                  "olmo3": Olmo2ForCausalLM}


def build_model(config: ModelConfig, lm_head: bool = True):
    """lm_head=False: the model of an embedding engine (--runner pooling), without its LM head."""
    return MODEL_REGISTRY[config.architecture](config, lm_head=lm_head)
