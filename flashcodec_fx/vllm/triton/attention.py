def triton_paged_attention(*a, **k):
    raise NotImplementedError
