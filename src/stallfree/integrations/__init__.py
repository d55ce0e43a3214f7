"""Adapters that put stallfree's scheduler inside other serving engines.

Imports allowed: the standard library, stallfree.core, and inside each adapter's subpackage the engine it
adapts (an optional extra, imported only when that subpackage is imported). Nothing here is imported by
`import stallfree`.

- stallfree.integrations.vllm: a scheduler class for vLLM v1 (`vllm serve --scheduler-cls`; docs/vllm.md).
"""
