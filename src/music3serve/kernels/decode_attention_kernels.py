"""The Triton kernels of decode attention, ``split`` and ``combine``; kernels/decode_attention.py describes and
launches them. Triton is imported on first use."""

import functools


@functools.cache
def triton_kernels():
    """Build the Triton kernels on first use (imports Triton)."""
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def norm_rotate(x_ptrs, partner_ptrs, mask, w_ptr, cos, sin, offs_d, eps, HEAD_DIM: tl.constexpr):
        """Rows of projections [.., HEAD_DIM] RMS-normed and rotated, rounding to the weight's dtype where torch
        does; partner_ptrs point at each element's rotation partner (d +- HEAD_DIM / 2)."""
        dtype = w_ptr.dtype.element_ty
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        partner = tl.load(partner_ptrs, mask=mask, other=0.0).to(tl.float32)
        inv_rms = libdevice.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / HEAD_DIM + eps)
        half = HEAD_DIM // 2
        partner_d = (offs_d + half) % HEAD_DIM
        w = tl.load(w_ptr + offs_d).to(tl.float32)
        w_partner = tl.load(w_ptr + partner_d).to(tl.float32)
        normed = (w * (x * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        normed_partner = (w_partner * (partner * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        rotated = tl.where(offs_d < half, -normed_partner, normed_partner)
        first = (normed * cos.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        second = (rotated * sin.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        return (first + second).to(dtype)

    @triton.jit
    def row_shares(len_ptr, row, capacity, NUM_SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr):
        """A row's filled length (clamped to [0, capacity]), the blocks of BLOCK_N positions in each of its shares, and
        how many shares hold a position: from the row's own length alone. Split writes and combine reads exactly
        these shares."""
        length = tl.load(len_ptr + row).to(tl.int32)
        length = tl.minimum(tl.maximum(length, 0), capacity)
        n_blocks = tl.cdiv(length, BLOCK_N)
        blocks_per_split = tl.maximum(tl.cdiv(n_blocks, NUM_SPLITS), SPLIT_BLOCKS)
        return length, blocks_per_split, tl.cdiv(n_blocks, blocks_per_split)

    @triton.jit
    def split_kernel(
        q_ptr, k_ptr, v_ptr, len_ptr, o_part_ptr, lse_part_ptr, out_ptr,
        k_new_ptr, v_new_ptr, pos_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr,
        stride_qr, stride_qh, stride_or, stride_oh,
        stride_kr, stride_kh, stride_kn,
        stride_vr, stride_vh, stride_vn,
        stride_knr, stride_knh, stride_vnr, stride_vnh, stride_rot,
        capacity, qk_scale_log2, eps,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        NUM_SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, APPEND: tl.constexpr,
        ROTATE: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # kernels/pdl.py: launched early, wait for the previous kernel before touching anything
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        kvh = tl.program_id(1)
        row = tl.program_id(2)
        q_heads = tl.num_programs(1) * GROUP

        length, blocks_per_split, n_active = row_shares(len_ptr, row, capacity, NUM_SPLITS, SPLIT_BLOCKS, BLOCK_N)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        heads = kvh * GROUP + offs_g

        row64 = row.to(tl.int64)
        q_rows = q_ptr + row64 * stride_qr + heads[:, None] * stride_qh
        if ROTATE:  # projections: norm and rotate as the torch ops do (decode_attention.py)
            partner_d = (offs_d + HEAD_DIM // 2) % HEAD_DIM
            cos = tl.load(cos_ptr + row64 * stride_rot + offs_d)
            sin = tl.load(sin_ptr + row64 * stride_rot + offs_d)
            q = norm_rotate(q_rows + offs_d[None, :], q_rows + partner_d[None, :], g_mask[:, None], q_norm_ptr,
                            cos[None, :], sin[None, :], offs_d[None, :], eps, HEAD_DIM)
        else:
            q = tl.load(q_rows + offs_d[None, :], mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]

        k_base = k_ptr + row64 * stride_kr + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + row64 * stride_vr + kvh.to(tl.int64) * stride_vh

        if APPEND:  # this row's new key and value: stored by the row's first program, used from registers by all
            pos = tl.load(pos_ptr + row).to(tl.int32)
            k_row = k_new_ptr + row64 * stride_knr + kvh * stride_knh
            if ROTATE:
                k_new = norm_rotate(k_row + offs_d, k_row + partner_d, offs_d < HEAD_DIM, k_norm_ptr, cos, sin, offs_d,
                                    eps, HEAD_DIM).to(k_ptr.dtype.element_ty)
            else:
                k_new = tl.load(k_row + offs_d).to(k_ptr.dtype.element_ty)
            v_new = tl.load(v_new_ptr + row64 * stride_vnr + kvh * stride_vnh + offs_d).to(v_ptr.dtype.element_ty)
            if (program == 0) & (pos >= 0) & (pos < capacity):
                tl.store(k_base + pos.to(tl.int64) * stride_kn + offs_d, k_new)
                tl.store(v_base + pos.to(tl.int64) * stride_vn + offs_d, v_new)

        # The shares of this row's length (its own, whatever the other rows), program by program: which program runs
        # a share changes nothing in it, so the program count may follow the row count (decode_attention.py).
        for split in range(program, tl.maximum(n_active, 1), programs):
            lo = split * blocks_per_split * BLOCK_N
            hi = tl.minimum(lo + blocks_per_split * BLOCK_N, length)
            m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
            acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

            for start in range(lo, hi, BLOCK_N):
                offs = start + offs_n
                n_mask = offs < hi
                k = tl.load(k_base + offs[:, None] * stride_kn + offs_d[None, :], mask=n_mask[:, None], other=0.0)
                v = tl.load(v_base + offs[:, None] * stride_vn + offs_d[None, :], mask=n_mask[:, None], other=0.0)
                if APPEND:
                    is_new = ((offs == pos) & n_mask)[:, None]  # never into a masked column (garbage stays out)
                    k = tl.where(is_new, k_new[None, :], k)
                    v = tl.where(is_new, v_new[None, :], v)
                s = tl.dot(q, tl.trans(k)) * qk_scale_log2  # [GROUP_PAD, BLOCK_N], log2 domain
                s = tl.where(n_mask[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new

            l_safe = tl.where(l_i > 0, l_i, 1.0)
            out = acc / l_safe[:, None]
            if NUM_SPLITS == 1:  # the whole row: the combine's result (weight exp2(0) = 1, zeros for no position)
                out_ptrs = out_ptr + row64 * stride_or + heads[:, None] * stride_oh + offs_d[None, :]
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
            else:  # only shares holding at least one position store; the combine reads exactly those
                lse = m_i + tl.log2(l_safe)
                part_row = (row64 * q_heads + heads) * NUM_SPLITS + split  # [GROUP_PAD]
                st_mask = g_mask & (lo < hi)
                tl.store(lse_part_ptr + part_row, lse, mask=st_mask)
                tl.store(o_part_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=st_mask[:, None])

    @triton.jit
    def combine_kernel(
        o_part_ptr, lse_part_ptr, len_ptr, out_ptr,
        stride_or, stride_oh,
        capacity,
        HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
        SPLIT_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        head = tl.program_id(0)
        row = tl.program_id(1)
        q_heads = tl.num_programs(0)

        _, _, n_active = row_shares(len_ptr, row, capacity, NUM_SPLITS, SPLIT_BLOCKS, BLOCK_N)

        # Pass 1: the max and the sum of the weights over all active splits' log-sum-exps (scalars, cheap).
        offs_s = tl.arange(0, SPLITS_PAD)
        part_base = (row.to(tl.int64) * q_heads + head) * NUM_SPLITS
        lse_all = tl.load(lse_part_ptr + part_base + offs_s, mask=offs_s < n_active, other=float("-inf"))
        m = tl.max(lse_all, axis=0)
        m = tl.where(n_active > 0, m, 0.0)
        total = tl.sum(tl.where(offs_s < n_active, tl.exp2(lse_all - m), 0.0), axis=0)
        total = tl.where(total > 0, total, 1.0)
        # Pass 2: the weighted partial outputs, CHUNK splits at a time (keeps the tile small for many splits).
        offs_c = tl.arange(0, CHUNK)
        offs_d = tl.arange(0, HEAD_DIM)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for c0 in range(0, n_active, CHUNK):
            sp = c0 + offs_c
            c_mask = sp < n_active
            lse = tl.load(lse_part_ptr + part_base + sp, mask=c_mask, other=float("-inf"))
            w = tl.where(c_mask, tl.exp2(lse - m), 0.0)
            o = tl.load(o_part_ptr + (part_base + sp)[:, None] * HEAD_DIM + offs_d[None, :], mask=c_mask[:, None],
                        other=0.0)  # fmt: skip
            acc += tl.sum(o * w[:, None], axis=0)
        out = acc / total
        out_ptrs = out_ptr + row.to(tl.int64) * stride_or + head * stride_oh + offs_d
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))

    return triton, split_kernel, combine_kernel
