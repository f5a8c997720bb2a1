"""Measurement tools beside the server: trace replay (`pagedkv bench`), KV token-state accounting, and the
contiguous pre-paging allocator they compare the paged one against. Nothing in the serving path imports this."""
