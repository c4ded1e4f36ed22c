// ZipFusion paged decode attention over compressed pages, CUDA (sm_80+). Design notes, the Python side and the
// launch: kvtide/kernels/zip_attention_cuda.py. Value order of a group: kvtide/cache/zip_order.py ("mma").
// Compiled by NVRTC with -DHEAD_DIM, -DVERSION, -DNWARPS, -DMIN_BLOCKS (and -DCTA_MERGE, -DSTAGE, -DBALANCED, and
// for diagnostics -DWARP_CLOCK); no header.
//
// One warp walks one split of one (sequence, KV head), one page (16 tokens) per step (a CTA holds NWARPS
// consecutive such units; with BALANCED, an equal run of all units' pages laid end to end, see zip_decode):
//   S^T[16 tok x 8 heads] = K[16 x D] Q^T        mma.m16n8k16, K rebuilt straight into A fragments
//   P^T = exp2(S^T - m) -> bf16, movmatrix.trans -> B fragments
//   O^T[D x 8 heads]     += V^T[D x 16] P^T      mma.m16n8k16, V rebuilt straight into A fragments
// Each lane loads, per 512-value block, its own 16 values: one 16-byte low-plane load + one 8-byte code load
// (compressed) or two 16-byte loads (raw); the next page's loads are issued as soon as a buffer is consumed, into
// registers or (STAGE 1, V only) by cp.async into the warp's slot of shared memory.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

#define D HEAD_DIM
#define NB (HEAD_DIM / 32)  // 512-value blocks per group (32 dims x 16 tokens each)
#define KS (HEAD_DIM / 16)  // k-steps of S^T = K Q^T, and m-tiles of O^T
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "HEAD_DIM must be 64 or 128"
#endif

// CTA_MERGE 1: a CTA's NWARPS warps are the NWARPS splits of one (sequence, KV head) and merge their partial outputs
// in shared memory at the end (no partials in global memory, no zip_merge launch).
#ifndef CTA_MERGE
#define CTA_MERGE 0
#endif
// BALANCED 1 (not with CTA_MERGE): warps take equal runs of all (sequence, KV head) page lists laid end to end
// instead of even splits of each; zip_merge_balanced merges the pieces. See zip_decode.
#ifndef BALANCED
#define BALANCED 0
#endif
#if BALANCED && CTA_MERGE
#error "BALANCED runs merge through global memory: it cannot be combined with CTA_MERGE"
#endif
// WARP_CLOCK 1 (diagnostics only, bench/tools/zip_warp_clock.py): each warp of zip_decode writes its start and end
// (%globaltimer ns), SM id and clock64 cycles into the buffer passed as ``clock``.
#ifndef WARP_CLOCK
#define WARP_CLOCK 0
#endif
// STAGE: where the next page's groups wait until they are used. 0: registers (8 x NB per lane for each of K and V);
// 1: V in the warp's slot of shared memory, copied by cp.async. A staged V frees its registers (Q then moves to
// shared memory too) and goes through L2 only (cp.async.cg). Shared memory is dynamic: WARP_SMEM bytes per warp, as
// zip_attention_cuda.smem_bytes computes them.
#ifndef STAGE
#define STAGE 0
#endif
#if STAGE != 0 && STAGE != 1
#error "STAGE must be 0 (registers) or 1 (V staged in shared memory)"
#endif
#define V_SMEM (STAGE == 1)
#define SLOT_BYTES (32 * D)                // one group: 16 x D bf16
#define WARP_SMEM (SLOT_BYTES + 16 * D)    // V slot, Q fragments

__device__ __forceinline__ void ldg128(const u8* p, u32 (&w)[8], int o) {
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(w[o]), "=r"(w[o + 1]), "=r"(w[o + 2]), "=r"(w[o + 3]) : "l"(p));
}

__device__ __forceinline__ void ldg64(const u8* p, u32 (&w)[8], int o) {
  asm("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(w[o]), "=r"(w[o + 1]) : "l"(p));
}

__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 movtrans(u32 x) {
  u32 y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u16 to_bf16(float x) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Each byte of x replaced by its top bit copied 8 times (prmt's sign-replicating selectors 8..11).
__device__ __forceinline__ u32 prmt_sign(u32 x) {
  u32 y;
  asm("prmt.b32 %0, %1, 0, 0xBA98;" : "=r"(y) : "r"(x));
  return y;
}

// Eight values of a compressed block -> four bf16x2 words (pairs 0-1, 2-3, 4-5, 6-7), byte-parallel: code word
// cw (nibbles n(v0) n(v2) n(v4) n(v6) n(v1) n(v3) n(v5) n(v7), n = sign << 3 | d), low words la (values 0-3,
// stored l0 l2 l1 l3) and lb (4-7). A value's high byte is sign << 7 | (b/2 + d), four at a time:
// he = [h0 h4 h1 h5] from the low nibbles of cw's bytes, ho = [h2 h6 h3 h7] from the high ones; one byte
// permute per pair then puts low and high bytes in place. b4 = (b/2) * 0x01010101.
// About 1.5 integer ops per value. zip_blocks.rebuild_words / zip_blocks.unpack are the torch references.
__device__ __forceinline__ void rebuild8(u32 cw, u32 la, u32 lb, u32 b4, bool esc, u32 (&w)[4]) {
  const u32 de = cw & 0x07070707u, dod = (cw >> 4) & 0x07070707u;
  u32 he = de + b4, ho = dod + b4;  // b/2 + d <= 127 for every stored value: no carry into the sign bit
#if VERSION == 2
  if (esc) {  // d = 7 codes an exact +-0 (b/2 + 7 may reach 133): clear the byte before the sign goes in (3 ops
              // per 4 values, fewer than a multiply-subtract form's 5)
    he &= ~prmt_sign(de + 0x79797979u);  // a byte of 0x80 (d = 7) -> 0xFF, d <= 6 -> 0x00
    ho &= ~prmt_sign(dod + 0x79797979u);
  }
#endif
  he |= (cw << 4) & 0x80808080u;
  ho |= cw & 0x80808080u;
  w[0] = __byte_perm(la, he, 0x6240);
  w[1] = __byte_perm(la, ho, 0x6341);
  w[2] = __byte_perm(lb, he, 0x7250);
  w[3] = __byte_perm(lb, ho, 0x7351);
}

// Fragments of the two k-steps (or m-tiles) one block gives a lane: raw words as they are, or rebuilt.
__device__ __forceinline__ void block_frags(const u32 (&b)[8], u32 dj, u32 (&a0)[4], u32 (&a1)[4]) {
  if (dj == 0xFFu) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a0[i] = b[i];
      a1[i] = b[4 + i];
    }
  } else {
    const u32 b4 = (dj & 0x7Fu) * 0x01010101u;
    const bool esc = (dj & 0x80u) != 0;
    rebuild8(b[4], b[0], b[1], b4, esc, a0);
    rebuild8(b[5], b[2], b[3], b4, esc, a1);
  }
}

// Issue the loads of one group (its NB blocks back to back from its start); they land while other work runs.
__device__ __forceinline__ void load_group(const u8* __restrict__ pool, u32 start16, u32 desc, u32 (&buf)[NB][8],
                                           int lane) {
  const u8* p = pool + ((u64)start16 << 4);
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    if (((desc >> (8 * j)) & 0xFFu) == 0xFFu) {
      ldg128(p + lane * 32, buf[j], 0);
      ldg128(p + lane * 32 + 16, buf[j], 4);
      p += 1024;
    } else {
      ldg128(p + lane * 16, buf[j], 0);
      ldg64(p + 512 + lane * 8, buf[j], 4);
      p += 768;
    }
  }
}

#if V_SMEM
__device__ __forceinline__ void cp_async16(u32 dst, const u8* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async8(u32 dst, const u8* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src));
}
// cp.async groups of this thread still in flight may be at most N
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// A group's lane bytes into a slot at the offsets they have in the pool: each lane copies, and later reads back,
// only its own bytes of a block (so a lane waits for its own copies only); __syncwarp before a slot is refilled
// orders the reuse across block kinds, whose lane offsets differ.
__device__ __forceinline__ void stage_group(const u8* __restrict__ pool, u32 start16, u32 desc, u32 slot, int lane) {
  const u8* p = pool + ((u64)start16 << 4);
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    if (((desc >> (8 * j)) & 0xFFu) == 0xFFu) {
      cp_async16(slot + lane * 32, p + lane * 32);
      cp_async16(slot + lane * 32 + 16, p + lane * 32 + 16);
      p += 1024;
      slot += 1024;
    } else {
      cp_async16(slot + lane * 16, p + lane * 16);
      cp_async8(slot + 512 + lane * 8, p + 512 + lane * 8);
      p += 768;
      slot += 768;
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// One staged block's lane words, as load_group would have put them in registers.
__device__ __forceinline__ void lds_block(u32 a, u32 dj, u32 (&b)[8], int lane) {
  if (dj == 0xFFu) {
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(a + lane * 32));
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(b[4]), "=r"(b[5]), "=r"(b[6]), "=r"(b[7]) : "r"(a + lane * 32 + 16));
  } else {
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(a + lane * 16));
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(b[4]), "=r"(b[5]) : "r"(a + 512 + lane * 8));
    b[6] = b[7] = 0u;
  }
}

// Fragments of a staged group's next block (descriptor byte dj) at slot address a, which moves past the block.
__device__ __forceinline__ void staged_frags(u32& a, u32 dj, int lane, u32 (&a0)[4], u32 (&a1)[4]) {
  u32 w[8];
  lds_block(a, dj, w, lane);
  a += dj == 0xFFu ? 1024 : 768;
  block_frags(w, dj, a0, a1);
}
#endif

// Storage tables of page `pid`: group starts in 16-byte units and the descriptor words of K and V.
__device__ __forceinline__ void load_meta(int pid, const long long* __restrict__ gstart,
                                          const u8* __restrict__ gdesc, int hkv, int h, u32 (&m)[4]) {
  if (pid < 0) {
    m[0] = m[1] = 0u;
    m[2] = m[3] = FULL;
    return;
  }
  const long long gi = ((long long)pid * hkv + h) * 2;
  m[0] = (u32)(gstart[gi] >> 4);
  m[1] = (u32)(gstart[gi + 1] >> 4);
#if NB == 4
  m[2] = ((const u32*)gdesc)[gi];
  m[3] = ((const u32*)gdesc)[gi + 1];
#else
  m[2] = ((const u16*)gdesc)[gi];
  m[3] = ((const u16*)gdesc)[gi + 1];
#endif
}

// Pages [p0, p0 + n) of sequence b's page list for KV head h: partial output and log-sum-exp into slot `split`
// (or, with num_splits 1 and not BALANCED, the output itself; with CTA_MERGE, merged over the CTA's warps).
__device__ __forceinline__ void attend(const u16* __restrict__ q, u16* __restrict__ out, float* __restrict__ opart,
                                       float* __restrict__ lse, const int* __restrict__ indptr,
                                       const int* __restrict__ indices, const u8* __restrict__ pool,
                                       const long long* __restrict__ gstart, const u8* __restrict__ gdesc,
                                       float scale_log2, int num_splits, int hkv, int group, int lane, int b, int h,
                                       int split, int p0, int n, int kv_len) {
#if !CTA_MERGE
  if (n <= 0) return;  // a split past this sequence's end: the merge reads only splits that hold tokens
#endif
  const int g = lane >> 2, t = lane & 3;
  const int hq_total = hkv * group;
  const long long row0 = (long long)b * hq_total + (long long)h * group;
#if V_SMEM
  extern __shared__ __align__(16) u8 dsm[];
  u8* const wsm = dsm + (threadIdx.x >> 5) * WARP_SMEM;  // this warp's part: [V slot][Q fragments]
  const u32 vslot = (u32)__cvta_generic_to_shared(wsm);
  uint4* const s_q = reinterpret_cast<uint4*>(wsm + SLOT_BYTES);  // [NB][32]
#endif

  // Q^T as the B operand: lane (g, t) holds q[head g][16 ks + 2t, +1] and [16 ks + 2t + 8, +9]; heads >= group: 0.
  // With staged groups the four words of block j's two k-steps sit in shared memory, 16 bytes per lane.
#if V_SMEM
  {
    const u32* qr = (const u32*)(q + (row0 + (g < group ? g : 0)) * D);
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      uint4 w;
      w.x = g < group ? qr[16 * j + t] : 0u;
      w.y = g < group ? qr[16 * j + t + 4] : 0u;
      w.z = g < group ? qr[16 * j + 8 + t] : 0u;
      w.w = g < group ? qr[16 * j + 8 + t + 4] : 0u;
      s_q[j * 32 + lane] = w;
    }
  }
#define BQ(j) const uint4 bqj = s_q[(j) * 32 + lane]
#define BQ0 bqj.x, bqj.y
#define BQ1 bqj.z, bqj.w
#else
  u32 bq[KS][2];
  {
    const u32* qr = (const u32*)(q + (row0 + (g < group ? g : 0)) * D);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      bq[ks][0] = g < group ? qr[8 * ks + t] : 0u;
      bq[ks][1] = g < group ? qr[8 * ks + t + 4] : 0u;
    }
  }
#define BQ(j)
#define BQ0 bq[2 * j][0], bq[2 * j][1]
#define BQ1 bq[2 * j + 1][0], bq[2 * j + 1][1]
#endif

  // Page metadata 32 pages at a time, lane i holding page i of the chunk; page ids one chunk ahead.
  const int* pidx = indices + indptr[b] + p0;
  u32 meta[4];
  load_meta(lane < n ? pidx[lane] : -1, gstart, gdesc, hkv, h, meta);
  int pid_next = 32 + lane < n ? pidx[32 + lane] : -1;

  u32 sk = __shfl_sync(FULL, meta[0], 0), sv = __shfl_sync(FULL, meta[1], 0);
  u32 dk = __shfl_sync(FULL, meta[2], 0), dv = __shfl_sync(FULL, meta[3], 0);
  u32 kb[NB][8];
  load_group(pool, sk, dk, kb, lane);
#if V_SMEM
  stage_group(pool, sv, dv, vslot, lane);
#else
  u32 vb[NB][8];
  load_group(pool, sv, dv, vb, lane);
#endif

  float o[KS][4];
#pragma unroll
  for (int i = 0; i < KS; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // heads 2t and 2t + 1

  for (int p = 0; p < n; ++p) {
    const int nx = p + 1;
    const bool more = nx < n;
    if (more && (nx & 31) == 0) {  // next chunk of metadata
      load_meta(pid_next, gstart, gdesc, hkv, h, meta);
      pid_next = nx + 32 + lane < n ? pidx[nx + 32 + lane] : -1;
    }
    u32 nsk = 0, nsv = 0, ndk = FULL, ndv = FULL;
    if (more) {
      nsk = __shfl_sync(FULL, meta[0], nx & 31);
      nsv = __shfl_sync(FULL, meta[1], nx & 31);
      ndk = __shfl_sync(FULL, meta[2], nx & 31);
      ndv = __shfl_sync(FULL, meta[3], nx & 31);
    }

    // S^T = K Q^T for this page's 16 tokens
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      u32 a0[4], a1[4];
      block_frags(kb[j], (dk >> (8 * j)) & 0xFFu, a0, a1);
      BQ(j);
      mma(s, a0, BQ0);
      mma(s, a1, BQ1);
    }
    if (more) load_group(pool, nsk, ndk, kb, lane);

    // online softmax in base 2; the running max moves only when a head's max grows by more than 2^8
    const int tok = (p0 + p) * 16 + g;
    float s0 = s[0] * scale_log2, s1 = s[1] * scale_log2, s2 = s[2] * scale_log2, s3 = s[3] * scale_log2;
    if (tok >= kv_len) s0 = s1 = NEG_INF;
    if (tok + 8 >= kv_len) s2 = s3 = NEG_INF;
    float x0 = fmaxf(s0, s2), x1 = fmaxf(s1, s3);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      x0 = fmaxf(x0, __shfl_xor_sync(FULL, x0, off));
      x1 = fmaxf(x1, __shfl_xor_sync(FULL, x1, off));
    }
    if (__any_sync(FULL, x0 > m0 + 8.f || x1 > m1 + 8.f)) {
      const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
      const float c0 = ex2(m0 - n0), c1 = ex2(m1 - n1);
#pragma unroll
      for (int i = 0; i < KS; ++i) {
        o[i][0] *= c0;
        o[i][1] *= c1;
        o[i][2] *= c0;
        o[i][3] *= c1;
      }
      l0 *= c0;
      l1 *= c1;
      m0 = n0;
      m1 = n1;
    }
    const float e0 = ex2(s0 - m0), e1 = ex2(s1 - m1), e2 = ex2(s2 - m0), e3 = ex2(s3 - m1);
    l0 += e0 + e2;
    l1 += e1 + e3;
    const u32 pb0 = movtrans(pack_bf16(e0, e1)), pb1 = movtrans(pack_bf16(e2, e3));

    // O^T += V^T P^T
#if V_SMEM
    cp_wait<0>();  // this page's V
    {
      u32 a = vslot;
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        u32 a0[4], a1[4];
        staged_frags(a, (dv >> (8 * j)) & 0xFFu, lane, a0, a1);
        mma(o[2 * j], a0, pb0, pb1);
        mma(o[2 * j + 1], a1, pb0, pb1);
      }
    }
    __syncwarp();
    if (more) stage_group(pool, nsv, ndv, vslot, lane);
#else
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      u32 a0[4], a1[4];
      block_frags(vb[j], (dv >> (8 * j)) & 0xFFu, a0, a1);
      mma(o[2 * j], a0, pb0, pb1);
      mma(o[2 * j + 1], a1, pb0, pb1);
    }
    if (more) load_group(pool, nsv, ndv, vb, lane);
#endif
    dk = ndk;
    dv = ndv;
  }

#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l0 += __shfl_xor_sync(FULL, l0, off);
    l1 += __shfl_xor_sync(FULL, l1, off);
  }
  const int hd0 = 2 * t, hd1 = 2 * t + 1;
#if CTA_MERGE
  {
    // Partials of this CTA's splits in shared memory, then each output value merged over them (log-sum-exp, as
    // zip_merge does); a split past the sequence's end (n <= 0) weighs nothing. With staged groups a warp's
    // partial output takes its V slot (8 x D fp32 = one slot), free once every lane has read it.
    const int w = threadIdx.x >> 5;
#if V_SMEM
    cp_wait<0>();  // a split with no pages staged its first groups and never waited for them
    __syncwarp();
#define S_O(sp, hd, dim) reinterpret_cast<float*>(dsm + (sp) * WARP_SMEM)[(hd) * D + (dim)]
#else
    __shared__ float s_o[NWARPS][8][D];
#define S_O(sp, hd, dim) s_o[sp][hd][dim]
#endif
    __shared__ float s_lse[NWARPS][8];
    const bool has = n > 0;
    const float i0 = has ? 1.f / l0 : 0.f, i1 = has ? 1.f / l1 : 0.f;
#pragma unroll
    for (int i = 0; i < KS; ++i) {
      const int dim = 16 * i + g;
      S_O(w, hd0, dim) = o[i][0] * i0;
      S_O(w, hd0, dim + 8) = o[i][2] * i0;
      S_O(w, hd1, dim) = o[i][1] * i1;
      S_O(w, hd1, dim + 8) = o[i][3] * i1;
    }
    if (g == 0) {
      s_lse[w][hd0] = has ? m0 + __log2f(l0) : NEG_INF;
      s_lse[w][hd1] = has ? m1 + __log2f(l1) : NEG_INF;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < group * D; idx += NWARPS * 32) {
      const int hd = idx / D, dim = idx % D;
      float mx = NEG_INF;
#pragma unroll
      for (int sp = 0; sp < NWARPS; ++sp) mx = fmaxf(mx, s_lse[sp][hd]);
      float sum = 0.f, acc = 0.f;
#pragma unroll
      for (int sp = 0; sp < NWARPS; ++sp) {
        const float wgt = ex2(s_lse[sp][hd] - mx);  // 2^-inf = 0 for an empty split
        sum += wgt;
        acc += wgt * S_O(sp, hd, dim);
      }
      out[(row0 + hd) * D + dim] = to_bf16(acc / sum);
    }
    return;
  }
#endif
  const float i0 = 1.f / l0, i1 = 1.f / l1;
  if (num_splits == 1 && !BALANCED) {
#pragma unroll
    for (int i = 0; i < KS; ++i) {
      const int dim = 16 * i + g;
      if (hd0 < group) {
        out[(row0 + hd0) * D + dim] = to_bf16(o[i][0] * i0);
        out[(row0 + hd0) * D + dim + 8] = to_bf16(o[i][2] * i0);
      }
      if (hd1 < group) {
        out[(row0 + hd1) * D + dim] = to_bf16(o[i][1] * i1);
        out[(row0 + hd1) * D + dim + 8] = to_bf16(o[i][3] * i1);
      }
    }
  } else {
    const long long r0 = (row0 + hd0) * num_splits + split, r1 = (row0 + hd1) * num_splits + split;
#pragma unroll
    for (int i = 0; i < KS; ++i) {
      const int dim = 16 * i + g;
      if (hd0 < group) {
        opart[r0 * D + dim] = o[i][0] * i0;
        opart[r0 * D + dim + 8] = o[i][2] * i0;
      }
      if (hd1 < group) {
        opart[r1 * D + dim] = o[i][1] * i1;
        opart[r1 * D + dim + 8] = o[i][3] * i1;
      }
    }
    if (g == 0) {
      if (hd0 < group) lse[r0] = m0 + __log2f(l0);
      if (hd1 < group) lse[r1] = m1 + __log2f(l1);
    }
  }
}

// One warp's share of the grid: its split (even splits) or its run of pages (BALANCED).
__device__ __forceinline__ void decode_warp(
    const u16* __restrict__ q, u16* __restrict__ out, float* __restrict__ opart, float* __restrict__ lse,
    const int* __restrict__ indptr, const int* __restrict__ indices, const int* __restrict__ kv_lens,
    const u8* __restrict__ pool, const long long* __restrict__ gstart, const u8* __restrict__ gdesc,
    float scale_log2, const int* __restrict__ split_pages, int num_splits, int hkv, int group, int batch) {
  const int lane = threadIdx.x & 31;
  const int unit = blockIdx.x * NWARPS + (threadIdx.x >> 5);
#if BALANCED
  // Every (sequence, KV head)'s page list laid end to end, sequence-major, and cut into runs of *split_pages pages,
  // one per warp, whatever the sequence boundaries: warps do equal work however the units fall on the SMs (even
  // splits leave a last wave nearly empty just past a wave boundary). A run crossing a boundary attends one piece
  // of each unit it meets; piece k of a unit is the k-th warp that touches it (zip_attention_cuda.balanced_pieces).
  const long long per_warp = *split_pages, total = (long long)hkv * indptr[batch];
  long long x = (long long)unit * per_warp;
  if (x >= total) return;
  const long long xe = min(x + per_warp, total);
  int lo = 0, hi = batch - 1;  // the last sequence whose list starts at or before x
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if ((long long)hkv * indptr[mid] <= x) lo = mid; else hi = mid - 1;
  }
  int b = lo;
  while (x < xe) {
    while ((long long)hkv * indptr[b + 1] <= x) ++b;  // past sequences without pages
    const long long base = (long long)hkv * indptr[b];
    const int len = indptr[b + 1] - indptr[b];
    const int h = (int)((x - base) / len), p0 = (int)(x - base - (long long)h * len);
    const int n = (int)min((long long)(len - p0), xe - x);
    const long long first = base + (long long)h * len;  // the unit's first page in the laid-out lists
    const int piece = unit - (int)(first / per_warp);
    attend(q, out, opart, lse, indptr, indices, pool, gstart, gdesc, scale_log2, num_splits, hkv, group, lane, b, h,
           piece, p0, n, kv_lens[b]);
    x += n;
  }
#else
  // warps of a CTA take consecutive (sequence, KV head, split) units, splits innermost: none idles
#if !CTA_MERGE  // with CTA_MERGE the grid is exact and every warp must reach the CTA's barrier
  if (unit >= batch * hkv * num_splits) return;
#endif
  const int split = unit % num_splits, h = (unit / num_splits) % hkv, b = unit / (num_splits * hkv);
  const int kv_len = kv_lens[b];
  // pages per split from device memory, not a launch argument: a captured CUDA graph stays valid as contexts grow
  const int pages_per_split = *split_pages;
  const int p0 = split * pages_per_split;
  attend(q, out, opart, lse, indptr, indices, pool, gstart, gdesc, scale_log2, num_splits, hkv, group, lane, b, h,
         split, p0, min((kv_len + 15) / 16 - p0, pages_per_split), kv_len);
#endif
}

#if WARP_CLOCK
__device__ __forceinline__ u64 global_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
#endif

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
zip_decode(const u16* __restrict__ q, u16* __restrict__ out, float* __restrict__ opart, float* __restrict__ lse,
           const int* __restrict__ indptr, const int* __restrict__ indices, const int* __restrict__ kv_lens,
           const u8* __restrict__ pool, const long long* __restrict__ gstart, const u8* __restrict__ gdesc,
           float scale_log2, const int* __restrict__ split_pages, int num_splits, int hkv, int group, int batch,
           int* __restrict__ clock) {
#if WARP_CLOCK
  // per warp of the grid: [start ns, end ns, SM id, clock64 cycles]
  const u64 t0 = global_ns();
  const long long c0 = clock64();
#endif
  decode_warp(q, out, opart, lse, indptr, indices, kv_lens, pool, gstart, gdesc, scale_log2, split_pages, num_splits,
              hkv, group, batch);
#if WARP_CLOCK
  const long long c1 = clock64();
  const u64 t1 = global_ns();
  if ((threadIdx.x & 31) == 0) {
    u32 sm;
    asm volatile("mov.u32 %0, %smid;" : "=r"(sm));
    u64* rec = reinterpret_cast<u64*>(clock) + 4 * ((u64)blockIdx.x * NWARPS + (threadIdx.x >> 5));
    rec[0] = t0;
    rec[1] = t1;
    rec[2] = sm;
    rec[3] = (u64)(c1 - c0);
  }
#endif
}

// out[b, hq, d] = sum_s 2^(lse_s - lse) o_s over pieces 0..n-1 of row (b, hq) (log-sum-exp merge): both merges.
// The first MERGE_CHUNK pieces' log-sum-exps and values are loaded together before any is used, so the merge waits
// on memory once, not twice per piece (a few pieces a row is the common case). Same arithmetic in the same order as
// a loop that loads one value at a time: the same bits.
#define MERGE_CHUNK 8
__device__ __forceinline__ void merge_pieces(const float* __restrict__ opart, const float* __restrict__ lse,
                                             u16* __restrict__ out, int b, int hq, int d, int n, int num_splits,
                                             int hq_total) {
  const long long row = ((long long)b * hq_total + hq) * num_splits;
  const float* l = lse + row;
  const float* o = opart + row * D + d;
  float lv[MERGE_CHUNK], ov[MERGE_CHUNK];
#pragma unroll
  for (int s = 0; s < MERGE_CHUNK; ++s) {
    lv[s] = s < n ? l[s] : NEG_INF;
    ov[s] = s < n ? o[(long long)s * D] : 0.f;
  }
  float mx = NEG_INF;
#pragma unroll
  for (int s = 0; s < MERGE_CHUNK; ++s) mx = fmaxf(mx, lv[s]);
  for (int s = MERGE_CHUNK; s < n; ++s) mx = fmaxf(mx, l[s]);
  float sum = 0.f, acc = 0.f;
#pragma unroll
  for (int s = 0; s < MERGE_CHUNK; ++s) {
    if (s < n) {
      const float w = ex2(lv[s] - mx);
      sum += w;
      acc += w * ov[s];
    }
  }
  for (int s = MERGE_CHUNK; s < n; ++s) {
    const float w = ex2(l[s] - mx);
    sum += w;
    acc += w * o[(long long)s * D];
  }
  out[((long long)b * hq_total + hq) * D + d] = to_bf16(acc / sum);
}

// The BALANCED walk's merge: unit (b, KV head of hq) holds pieces 0..k-1, k the warps whose runs meet its pages.
extern "C" __global__ void zip_merge_balanced(const float* __restrict__ opart, const float* __restrict__ lse,
                                              u16* __restrict__ out, const int* __restrict__ indptr,
                                              const int* __restrict__ split_pages, int num_splits, int hq_total,
                                              int group) {
  const int b = blockIdx.x, hq = blockIdx.y, d = threadIdx.x;
  const long long per_warp = *split_pages, hkv = hq_total / group, len = indptr[b + 1] - indptr[b];
  const long long first = hkv * indptr[b] + (hq / group) * len;
  const int n = len > 0 ? (int)((first + len - 1) / per_warp - first / per_warp) + 1 : 0;
  merge_pieces(opart, lse, out, b, hq, d, n, num_splits, hq_total);
}

// out[b, hq] = sum_s 2^(lse_s - lse) o_s over the splits that hold tokens (log-sum-exp merge), one thread per dim.
extern "C" __global__ void zip_merge(const float* __restrict__ opart, const float* __restrict__ lse,
                                     u16* __restrict__ out, const int* __restrict__ kv_lens,
                                     const int* __restrict__ split_pages, int num_splits, int hq_total) {
  const int b = blockIdx.x, hq = blockIdx.y, d = threadIdx.x;
  const int split_tokens = 16 * *split_pages;
  const int n = (kv_lens[b] + split_tokens - 1) / split_tokens;
  merge_pieces(opart, lse, out, b, hq, d, n, num_splits, hq_total);
}
