"""The Triton kernel of the paged-attention backend (attention/triton_paged.py says how it works and why it is
batch-invariant). Importing this module needs triton; under TRITON_INTERPRET=1 (read when the kernel is defined, at
import) it runs on CPU tensors through Triton's interpreter."""

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    tile_seq_ptr, tile_first_ptr,  # per query tile: its sequence, its first query (within the sequence)
    query_start_ptr, num_queries_ptr, num_keys_ptr, block_tables_ptr,  # per sequence
    stride_q_token, stride_q_head, stride_kv_slot, stride_kv_head, stride_out_token, stride_out_head,
    stride_table, scale, window,  # window > 0: a row sees only its last `window` keys (sliding-window attention)
    softcap,  # with CAPPED: each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)
    CAPPED: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KEYS: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    query_start = tl.load(query_start_ptr + seq)
    num_queries = tl.load(num_queries_ptr + seq)
    num_keys = tl.load(num_keys_ptr + seq)
    context = num_keys - num_queries  # the position of the sequence's first query in this step

    rows = tl.arange(0, TOKENS * GROUP_PAD)
    local = first + rows // GROUP_PAD  # query index within the sequence
    head_in_group = rows % GROUP_PAD
    row_valid = (local < num_queries) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    token = query_start + local
    position = context + local  # the row sees keys 0..position
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    q = tl.load(q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    row_max = tl.full([TOKENS * GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([TOKENS * GROUP_PAD], tl.float32)
    acc = tl.zeros([TOKENS * GROUP_PAD, HEAD_DIM_PAD], tl.float32)

    last_query = tl.minimum(first + TOKENS, num_queries)
    key_end = context + last_query  # keys the tile's last query sees
    # Under a window the walk starts at the key tile holding the tile's first query's first key: tiles stay at
    # multiples of KEYS, and a tile wholly outside a row's window leaves that row's state as it was (see below).
    key_begin = 0
    if window > 0:
        key_begin = tl.maximum(context + first - window + 1, 0) // KEYS * KEYS
    for key_start in range(key_begin, key_end, KEYS):
        keys = key_start + tl.arange(0, KEYS)
        key_valid = keys < key_end
        block = tl.load(block_tables_ptr + seq * stride_table + keys // BLOCK_SIZE, mask=key_valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        kv_offsets = slot * stride_kv_slot + kv_head * stride_kv_head
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        visible = (keys[None, :] <= position[:, None]) & key_valid[None, :]
        if window > 0:
            visible = visible & (keys[None, :] > position[:, None] - window)
        scores = scores * scale
        if CAPPED:  # tanh from exp (libdevice's has no interpreter route): sign(s) (1 - e^-2|s|) / (1 + e^-2|s|)
            e = tl.exp(-2.0 * tl.abs(scores / softcap))
            scores = tl.where(scores < 0, -softcap, softcap) * (1.0 - e) / (1.0 + e)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # rows with nothing visible yet (padding rows; under a window, rows whose window starts in a later tile) keep
        # max -inf, sum 0 and accumulator 0: the tile adds exp(-inf) = 0 to each
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(row_max - safe_max)
        probs = tl.exp(scores - safe_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
        row_max = new_max

    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    tl.store(out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
