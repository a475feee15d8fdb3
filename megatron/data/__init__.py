"""Megatron-LM 23.05's `megatron.data` import path, for ported data scripts: only
`indexed_dataset` (see that module). The datasets themselves live in
`megatron.core.datasets`."""
