"""The commands over the integrations: ``export --format hf`` (:mod:`.hf_export`), ``olmo-core
train`` (:mod:`.olmo_train`) and ``import-olmo-core`` (:mod:`.olmo_import`). They read and write our
run folders through the tasks; ``hf`` and ``olmo_core`` below them never do (docs/tasks.md, "The
import graph").
"""
