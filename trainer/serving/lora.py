"""LoRA slots of ``twin serve``: load, unload and activate peft adapters on one base model.

Adapters are peft LoRA adapters on one copy of the base model. An adapter is resolved when its
request arrives (:meth:`AdapterSlots.resolve`), so a request finishes on the adapter version it
started with even if the name is unloaded or replaced meanwhile (a version is deleted from the
model once no request needs it). At most ``max_loras`` adapters stay resident; others are
reloaded from disk on use. A new adapter of the same LoRA shape is copied into a freed slot
instead of building LoRA modules in every target layer. A load that fails leaves the model, the
loaded adapters and their outputs exactly as they were. With an adapter root, only adapters
under it load (``docs/security.md``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.serving.api import LoadAdapterRequest, ServerError, UnloadAdapterRequest, validate

if TYPE_CHECKING:
    import torch

__all__ = ["Adapter", "AdapterSlots"]

log = logging.getLogger("twinrl.serve")


@dataclass(eq=False)
class Adapter:
    """One loaded adapter version. ``key`` is the peft adapter name inside the model, unique per
    load."""

    name: str
    path: str
    key: str
    created: int = field(default_factory=lambda: int(time.time()))
    pending: int = 0  # queued or running requests that resolved to this version
    retired: bool = False  # unloaded or replaced; deleted from the model once pending == 0


#: Free adapter slots kept for in-place loads (each holds one adapter's LoRA weights).
_FREE_SLOTS = 2


def _lora_shape(config: Any) -> tuple[Any, ...]:
    """What must match for one LoRA adapter's weights to be copied into another's slot."""
    targets = config.target_modules
    return (
        config.r,
        config.lora_alpha,
        tuple(sorted(targets)) if isinstance(targets, (list, set)) else targets,
        tuple(sorted(config.modules_to_save or ())),
        config.use_rslora,
        config.use_dora,
        config.bias,
        config.fan_in_fan_out,
        str(config.layers_to_transform),
        str(sorted((config.rank_pattern or {}).items())),
        str(sorted((config.alpha_pattern or {}).items())),
        str(config.lora_dropout),
    )


class AdapterSlots:
    """The adapters loaded into one model, and the peft slots that hold them.

    Args:
        model: The base model; the first load wraps it in a ``peft.PeftModel`` in place.
        model_name: The base model's name (no adapter may take it).
        max_loras: Adapters kept resident at once.
        adapter_root: Only adapters under this folder load (resolved); None: any folder.
        lock: Guards the adapter tables (the server's queue lock, so ``pending`` counts and the
            queue change together).
        model_lock: Held while the model runs or its adapters change.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        model_name: str,
        max_loras: int,
        adapter_root: Path | None,
        lock: threading.Lock,
        model_lock: threading.Lock,
    ) -> None:
        self.model = model
        self.model_name = model_name
        self.max_loras = max_loras
        self.adapter_root = adapter_root
        self.device = next(model.parameters()).device
        self.adapters: dict[str, Adapter] = {}  # public name -> current version
        self.resident: collections.OrderedDict[str, Adapter] = (
            collections.OrderedDict()
        )  # key -> version (LRU)
        self._loaded_keys = 0
        self.peft: Any = None  # peft.PeftModel around self.model, made on the first adapter load
        # peft adapter slots no version owns any more, kept to load the next adapter of the same
        # shape into in place: peft's load_adapter builds LoRA modules in every target layer
        self.free: list[str] = []
        self._lock = lock
        self._model_lock = model_lock

    def resolve(self, name: str) -> Adapter | None:
        """The current version of adapter ``name`` (None for the base model).

        Raises:
            ServerError: 404 no adapter of that name is loaded.
        """
        if name == self.model_name:
            return None
        with self._lock:
            adapter = self.adapters.get(name)
        if adapter is None:
            raise ServerError(f"The model `{name}` does not exist.", 404)
        return adapter

    def listing(self) -> list[Adapter]:
        """The loaded adapters, in load order."""
        with self._lock:
            return list(self.adapters.values())

    def load(self, body: dict[str, Any]) -> str:
        """Handle ``POST /v1/load_lora_adapter``; return vLLM's success text.

        Raises:
            ServerError: 400 missing fields or an existing name without ``load_inplace``;
                403 a path outside the adapter root; 404 the path holds no
                ``adapter_config.json``; 500 peft failed to load it.
        """
        request = validate(LoadAdapterRequest, body, "load_lora_adapter request")
        name, inplace = request.lora_name, request.load_inplace
        if name == self.model_name:
            raise ServerError(
                f"The lora adapter name '{name}' is the base model's name; choose another.", 400
            )
        with self._lock:
            if name in self.adapters and not inplace:
                raise ServerError(
                    f"The lora adapter '{name}' has already been loaded. "
                    'Pass "load_inplace": true to replace it, or load it under a new name.',
                    400,
                )
        path = self._adapter_path(request.lora_path)
        try:
            found = (path / "adapter_config.json").is_file()
        except OSError as exc:  # a name too long for the file system
            raise ServerError(
                f"lora_path {request.lora_path[:200]!r} cannot be read: {exc.strerror}", 400
            ) from None
        if not found:
            raise ServerError(
                f"Loading lora {name} failed: No adapter found for {request.lora_path}", 404
            )
        self._check_files_inside_root(path, request.lora_path)
        with self._lock:
            self._loaded_keys += 1
            version = Adapter(name=name, path=str(path), key=f"lora{self._loaded_keys}")
        # Load eagerly so a broken adapter is an error now, not in the first request.
        with self._model_lock:
            try:
                self._make_resident(version)
            except Exception as exc:
                raise ServerError(
                    f"Loading lora {name} from {request.lora_path} failed: {type(exc).__name__}: "
                    f"{exc}",
                    500,
                ) from exc
            with self._lock:
                old = self.adapters.get(name)
                if old is not None:
                    old.retired = True
                self.adapters[name] = version
            self.collect()
        log.info("loaded adapter %s from %s", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict[str, Any]) -> str:
        """Handle ``POST /v1/unload_lora_adapter``; requests already queued on it still finish.

        Raises:
            ServerError: 400 no ``lora_name``; 404 no adapter of that name is loaded.
        """
        name = validate(UnloadAdapterRequest, body, "unload_lora_adapter request").lora_name
        with self._lock:
            version = self.adapters.pop(name, None)
            if version is None:
                raise ServerError(f"The lora adapter '{name}' cannot be found.", 404)
            version.retired = True
        with self._model_lock:
            self.collect()
        log.info("unloaded adapter %s", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def activate(self, adapter: Adapter | None) -> None:
        """Make ``adapter`` (None: the base model) the one the model runs with. Holds the model
        lock."""
        if adapter is None:
            if self.peft is not None:
                self.peft.base_model.disable_adapter_layers()
            return
        self._make_resident(adapter)
        self.peft.base_model.enable_adapter_layers()
        self.peft.set_adapter(adapter.key)

    def collect(self) -> None:
        """Delete retired versions that no request still needs. Holds the model lock."""
        with self._lock:
            dead = [k for k, v in self.resident.items() if v.retired and v.pending == 0]
        for key in dead:
            self._delete(key)

    def _adapter_path(self, lora_path: str) -> Path:
        """The folder to load ``lora_path`` from; with an adapter root, its resolved form under it.

        Raises:
            ServerError: 403 the resolved path is outside the adapter root (checked before its
                existence, so a client learns nothing about folders outside the root).
        """
        path = Path(lora_path)
        if self.adapter_root is None:
            return path
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop
            raise ServerError(f"lora_path {lora_path!r} cannot be resolved: {exc}", 400) from None
        if not resolved.is_relative_to(self.adapter_root):
            raise ServerError(
                f"lora_path {lora_path!r} is outside this server's adapter root (twin serve "
                "--adapter-root); "
                "only adapters under it load",
                403,
            )
        return resolved  # load what was checked, not a path whose links may change

    def _check_files_inside_root(self, folder: Path, lora_path: str) -> None:
        """403 when a file of the adapter folder is a link to a file outside the adapter root
        (peft reads the folder's own entries: its config and weights)."""
        if self.adapter_root is None:
            return
        try:
            outside = [
                e.name
                for e in folder.iterdir()
                if not e.resolve().is_relative_to(self.adapter_root)
            ]
        except (OSError, RuntimeError) as exc:
            raise ServerError(f"lora_path {lora_path[:200]!r} cannot be read: {exc}", 400) from None
        if outside:
            raise ServerError(
                f"lora_path {lora_path[:200]!r} holds {', '.join(sorted(outside)[:3])}, linked to "
                "a file outside this server's adapter root (twin serve --adapter-root); only "
                "files under it load",
                403,
            )

    def _make_resident(self, version: Adapter) -> None:
        """Load ``version`` into the model if it is not (evicting the least recently used). Holds
        the model lock."""
        if version.key in self.resident:
            self.resident.move_to_end(version.key)
            return
        from peft import PeftModel

        if self.peft is None:
            # Wraps (and injects LoRA layers into) self.model in place; generation keeps calling
            # self.model, whose LoRA layers follow the PeftModel's active adapter.
            try:
                self.peft = PeftModel.from_pretrained(
                    self.model, version.path, adapter_name=version.key
                )
            except BaseException:
                _strip_lora_layers(self.model)
                raise
        elif not self._load_into_free_slot(version):
            try:
                self.peft.load_adapter(version.path, adapter_name=version.key)
            except BaseException:
                self._drop_partial_adapter(version.key)
                raise
        self.resident[version.key] = version
        while len(self.resident) > self.max_loras:
            self._delete(next(iter(self.resident)))

    def _drop_partial_adapter(self, key: str) -> None:
        """Remove what a failed ``load_adapter`` added (peft builds the LoRA modules, then loads
        weights)."""
        if key not in self.peft.peft_config:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.peft.delete_adapter(key)
        # delete_adapter may make what it left active; the served adapters are set per batch anyway
        self.peft.base_model.disable_adapter_layers()

    def _load_into_free_slot(self, version: Adapter) -> bool:
        """Copy ``version``'s weights into a free slot of the same LoRA shape; False when none fits.

        The trainer loads a new adapter of one shape every step and unloads an old one; copying
        the weights in place skips building LoRA modules in every target layer (on the tiny
        model a load fell from ~0.04 s to ~0.014 s).
        """
        from peft import LoraConfig
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        if not self.free:
            return False
        config = LoraConfig.from_pretrained(version.path)
        shape = _lora_shape(config)
        slot = next((k for k in self.free if _lora_shape(self.peft.peft_config[k]) == shape), None)
        if slot is None:
            return False
        weights = load_peft_weights(version.path, device=str(self.device))
        result = set_peft_model_state_dict(self.peft, weights, adapter_name=slot)
        missing = [k for k in getattr(result, "missing_keys", []) if f".{slot}." in k]
        if missing:  # a partial copy would mix two adapters: load it the ordinary way instead
            log.warning(
                "adapter %s does not fill slot %s (%d missing keys); loading it anew",
                version.name,
                slot,
                len(missing),
            )
            return False
        self.free.remove(slot)
        version.key = slot
        return True

    def _delete(self, key: str) -> None:
        # peft keeps at least one adapter; the last one stays (unreachable by name) until replaced.
        if len(self.resident) > 1:
            assert self.peft is not None
            version = self.resident.pop(key)
            # A version evicted while still served is reloaded later under a new key: its old
            # key's slot may hold another adapter's weights by then.
            with self._lock:  # load_lora_adapter numbers keys on an HTTP thread
                self._loaded_keys += 1
                version.key = f"lora{self._loaded_keys}"
            if len(self.free) < _FREE_SLOTS:
                self.free.append(key)
                return
            with warnings.catch_warnings():  # "adapter X was active which is now deleted": expected
                warnings.simplefilter("ignore", UserWarning)
                self.peft.delete_adapter(key)


def _strip_lora_layers(model: torch.nn.Module) -> None:
    """Put back every layer peft wrapped in ``model`` (a failed first load leaves them active)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if name and isinstance(module, BaseTunerLayer):
            parent_name, _, child = name.rpartition(".")
            setattr(
                model.get_submodule(parent_name) if parent_name else model,
                child,
                module.get_base_layer(),
            )
    if "peft_config" in vars(model):
        del model.peft_config
