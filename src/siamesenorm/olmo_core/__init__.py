"""OLMo-core integration (the ``olmo`` extra): every residual scheme of the package as an OLMo-core
``Transformer``, and the map of configuration and parameters between it and our ``LanguageModel``::

    from siamesenorm.models import LMConfig
    from siamesenorm.olmo_core import olmo_config

    config = olmo_config(LMConfig(dim=256, n_layers=4, n_heads=4, scheme="siamese",
                                  scheme_options={"form": "hybrid_pre"}))
    model = config.build(init_device="meta")          # an olmo_core Transformer
    # TransformerTrainModuleConfig(...).build(model) trains it like any OLMo-core model

A user's own ``TransformerConfig`` (OLMo2, Llama, OLMoE, ...) takes a scheme with
``from_transformer_config(config, scheme="siamese")``; ``load_olmo_core_state`` and
``olmo_core_state_dict`` move weights between OLMo-core's own model and its scheme model.

OLMo-core builds the attention and feed-forward of every block; the scheme (``model.scheme``) puts
every norm and residual add around them. See docs/olmo-core.md. Only the commands import this
package (``olmo-core train``, ``import-olmo-core``); it imports no task, run or command.
"""

from __future__ import annotations

import logging

try:
    import olmo_core  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError("siamesenorm.olmo_core needs OLMo-core: pip install 'siamesenorm[olmo]'") from error

# OLMo-core warns on import, through logging's last-resort stderr handler where logging is not
# configured, that the optional transformer_engine is absent; keep that off a bare process's stderr
# (a configured root logger still shows it)
_TE_LOG = logging.getLogger("olmo_core.nn.attention.te_attn_api")
_QUIET = logging.NullHandler()
if not logging.getLogger().handlers:
    _TE_LOG.addHandler(_QUIET)
try:
    import olmo_core.nn.attention  # noqa: F401,E402
finally:
    _TE_LOG.removeHandler(_QUIET)

from .convert import (  # noqa: E402
    from_language_model,
    from_siamesenorm_state_dict,
    lm_config,
    olmo_config,
    olmo_moe_config,
    to_language_model,
    to_siamesenorm_state_dict,
)
from .hf_folder import save_hf_model  # noqa: E402
from .model import (  # noqa: E402
    QKVNormAttention,
    SchemeBlock,
    SchemeBlockConfig,
    SchemeTransformer,
    SchemeTransformerConfig,
    head_norm_config,
)
from .moe import (  # noqa: E402
    CheckpointSafeRouter,
    PortableDroplessMLP,
    SchemeMoEBlock,
    SchemeMoETransformer,
)
from .user_config import OWN_OPTIONS, OWN_SCHEME, from_transformer_config  # noqa: E402
from .weights import (  # noqa: E402
    load_olmo_core_state,
    map_from_olmo_core,
    map_to_olmo_core,
    olmo_core_state_dict,
)

__all__ = ["OWN_OPTIONS", "OWN_SCHEME", "CheckpointSafeRouter", "DiagnosticsCallback",
           "PortableDroplessMLP", "QKVNormAttention",
           "SchemeBlock", "SchemeBlockConfig", "SchemeMoEBlock", "SchemeMoETransformer",
           "SchemeTransformer", "SchemeTransformerConfig", "from_language_model",
           "from_siamesenorm_state_dict", "from_transformer_config", "head_norm_config", "lm_config",
           "load_olmo_core_state", "map_from_olmo_core", "map_to_olmo_core", "olmo_config",
           "olmo_core_state_dict", "olmo_moe_config", "save_hf_model", "to_language_model",
           "to_siamesenorm_state_dict"]


def __getattr__(name: str):     # OLMo-core's trainer modules load on first use
    if name == "DiagnosticsCallback":
        from .diagnostics import DiagnosticsCallback
        return DiagnosticsCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
