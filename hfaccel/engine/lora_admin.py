"""The engine's LoRA adapters by name: which one a request names, adding and removing them while the engine serves."""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping, Sequence

from hfaccel.engine.scheduler import Request
from hfaccel.kv.hf_cache import paged_reader_backend
from hfaccel.lora import LoRAAdapter, LoRAManager


class LoRAAdmin:
    """A part of :class:`~hfaccel.engine.Engine`: its ``loras`` (None without LoRA) by name, and its ``requests``
    that use them."""

    loras: LoRAManager | None
    requests: dict[str, Request]

    def _serve_loras(
        self,
        model,
        adapters: Mapping[str, str | os.PathLike] | None,
        max_loras: int,
        max_rank: int,
        target_modules: Sequence[str] | None,
    ) -> None:
        """Wrap the model's Linear layers for ``adapters`` (None: no LoRA, the model unchanged), each adapter checked
        first; the model gets its own layers back when the engine closes or is collected."""
        self.loras = (
            None
            if adapters is None
            else LoRAManager(
                model,
                adapters,
                max_loras=max_loras,
                max_rank=max_rank,
                target_modules=target_modules,
                backend=paged_reader_backend(model.config) or "auto",
            )
        )
        if self.loras is not None:
            weakref.finalize(self, self.loras.close)  # the model's own layers back even without close()

    def lora_adapter(self, name: str | None) -> LoRAAdapter | None:
        """The LoRA adapter served as ``name`` (None: the base model), or a ValueError naming those there are."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise ValueError(f"lora must be the name of a LoRA adapter (a string) or None; got {type(name).__name__}")
        if self.loras is None:
            raise ValueError(
                f"this engine serves no LoRA adapters (lora={name!r}); make it with "
                "Engine(..., lora_adapters={name: path}) (or lora_adapters={} and add_lora later)"
            )
        return self.loras.get(name)

    def add_lora(self, name: str, path: str | os.PathLike) -> None:
        """Serve the PEFT LoRA adapter at ``path`` as ``name`` from now on (read and checked here: a ValueError says
        what does not fit, and changes nothing). Needs an engine made with ``lora_adapters`` (``{}`` will do)."""
        self._lora_manager("add_lora").add(name, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving the adapter ``name``. Refused (ValueError) while unfinished requests use it: abort them or
        let them finish first. Requests already prepared for it but not yet added are refused when added."""
        manager = self._lora_manager("remove_lora")
        adapter = manager.get(name)
        users = [
            request.request_id for request in self.requests.values() if request.lora is adapter and not request.finished
        ]
        if users:
            raise ValueError(
                f"the LoRA adapter {name!r} is in use by {len(users)} unfinished request(s) "
                f"({', '.join(users[:5])}{', ...' if len(users) > 5 else ''}); abort them or let them "
                "finish, then remove it"
            )
        manager.remove(name)

    def list_loras(self) -> list[str]:
        """The names of the LoRA adapters served (empty without LoRA)."""
        return [] if self.loras is None else self.loras.names()

    def _check_registered(self, adapter: LoRAAdapter | None) -> None:
        """ValueError if a prepared request's adapter was removed since it was prepared."""
        if adapter is not None and (self.loras is None or not self.loras.is_registered(adapter)):
            raise ValueError(
                f"the LoRA adapter {adapter.name!r} was removed from this engine after the request was prepared"
            )

    def _lora_manager(self, what: str) -> LoRAManager:
        if self.loras is None:
            raise ValueError(
                f"Engine.{what}: this engine was made without LoRA; make it with "
                "Engine(..., lora_adapters={...}) ({} to add adapters later)"
            )
        return self.loras
