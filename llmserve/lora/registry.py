"""The server's adapters by name: those given with --lora-modules, and those loaded at run time, whose folders must lie
inside a directory the operator allowed (--lora-dir).

Confinement is decided on the path before anything under it is opened: a `..` component is refused outright, and the
real path (symlinks resolved) must lie inside the real path of an allowed directory, so a link pointing out of it is
refused too. Each registration gets a fresh lora_int_id, so an adapter reloaded under an old name never meets the
previous one's prefix-cache entries.
"""

from __future__ import annotations

import itertools
import os
from pathlib import PurePath

from llmserve.errors import InvalidRequestError
from llmserve.lora.request import LoRARequest


class LoRANotFoundError(InvalidRequestError):
    status_code = 404
    error_type = "NotFoundError"


class ModelNotFoundError(LoRANotFoundError):
    """A request's `model` names neither the base model nor an adapter being served."""

    code = "model_not_found"

    def __init__(self, name: str):
        super().__init__(f"The model `{name}` does not exist.", "model")
        self.args = (name,)  # what unpickling (from the engine process) calls the class with


class LoRAExistsError(InvalidRequestError):
    code = "lora_adapter_exists"

    def __init__(self, name: str):
        super().__init__(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        self.args = (name,)


def parse_lora_module(text: str) -> tuple[str, str]:
    """--lora-modules item: name=path (or vLLM's JSON form {"name": ..., "path": ...})."""
    if text.lstrip().startswith("{"):
        import json

        try:
            item = json.loads(text)
            return str(item["name"]), str(item["path"])
        except (ValueError, KeyError, TypeError):
            raise InvalidRequestError(f"--lora-modules: cannot read {text!r}; use name=path or "
                                      '{"name": ..., "path": ...}', "lora_modules") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise InvalidRequestError(f"--lora-modules: {text!r} is not name=path", "lora_modules")
    return name, path


class LoRARegistry:
    def __init__(self, allowed_dirs: list[str] | None = None):
        self.allowed_dirs = [os.path.realpath(d) for d in allowed_dirs or []]
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def new_request(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(name, next(self._ids), path)

    def register(self, request: LoRARequest) -> None:
        self.adapters[request.lora_name] = request

    def unregister(self, name: str) -> LoRARequest:
        request = self.adapters.pop(name, None)
        if request is None:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.", "lora_name")
        return request

    def confine(self, path: str) -> str:
        """The real path of a folder a client named, if it lies inside an allowed directory (else 400)."""
        if not self.allowed_dirs:
            raise InvalidRequestError("this server allows no adapter folders (start it with --lora-dir)", "lora_path")
        if not path or "\x00" in path:
            raise InvalidRequestError("lora_path must be a folder path", "lora_path")
        if ".." in PurePath(path).parts:
            raise InvalidRequestError("lora_path must not contain '..'", "lora_path")
        candidates = [path] if os.path.isabs(path) else [os.path.join(d, path) for d in self.allowed_dirs]
        candidates.sort(key=lambda c: not os.path.isdir(c))  # a relative path: the first allowed directory holding it
        for candidate in candidates:
            real = os.path.realpath(candidate)
            for allowed in self.allowed_dirs:
                if real != allowed and os.path.commonpath([real, allowed]) == allowed:
                    return real
        raise InvalidRequestError("lora_path is outside the directories this server allows adapters from "
                                  "(--lora-dir)", "lora_path")
