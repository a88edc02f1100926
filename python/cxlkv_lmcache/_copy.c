/* Bulk copies between LMCache buffers and the pool with streaming
 * (non-temporal) stores.
 *
 * A plain memcpy of a multi-MiB object reads every destination line before
 * writing it (read-for-ownership) and evicts the caller's working set from the
 * caches. Neither helps here: the pool side is read later by another process
 * (or node), and on CXL memory the extra reads cross the link. Streaming stores
 * skip both; on the reference VM they copy 2 MiB objects ~1.5x faster than
 * glibc's memcpy (docs/BENCHMARKS.md). Small copies stay with memcpy.
 *
 * Built as an optional extension: without a C compiler the package falls back
 * to ctypes.memmove (cxlkv_lmcache.client.COPY tells which one is in use).
 *
 * Pools that several hosts share are not cache-coherent (PoolInfo.coherence
 * "software"). Then `store` streams from STORE_STREAM_MIN bytes on (every
 * line must reach memory anyway, and streaming stores get it there without
 * reading it first: faster than plain stores + write-back at every size
 * measured, docs/benchmark-findings.md) and writes back every line it wrote
 * with plain stores (clwb, else clflushopt, else clflush), `fence` (sfence,
 * once per batch) orders all of it before the caller's Commit, and
 * `invalidate` evicts a range (clflushopt, else clflush, then mfence) so a
 * load reads what other hosts flushed, not a stale copy.
 *
 * `plan` runs the same copy routine with steps that only record what they
 * would do: the sidecar's "noncoherent-test" backend (python/client.py)
 * replays them, so a missing write-back or fence there loses bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

/* Below this, the destination is likely read again soon and fits in cache. */
#define STREAM_MIN ((size_t)512 << 10)
/* With software coherence: from here on a whole aligned 128-byte block always
 * exists to stream; streaming beat plain stores + write-back at every size
 * measured, 192 B up (docs/benchmark-findings.md). */
#define STORE_STREAM_MIN ((size_t)256)

#if STREAMING
__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
}

static void stream_sse2(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 128) {
        for (size_t j = 0; j < 128; j += 16)
            _mm_stream_si128((__m128i *)(d + i + j), _mm_loadu_si128((const __m128i *)(s + i + j)));
    }
}

static int have_avx2, have_clwb, have_clflushopt;

#define LINE ((uintptr_t)64)

__attribute__((target("clwb"))) static void lines_clwb(uintptr_t p, uintptr_t end) {
    for (; p < end; p += LINE)
        _mm_clwb((void *)p);
}

__attribute__((target("clflushopt"))) static void lines_clflushopt(uintptr_t p, uintptr_t end) {
    for (; p < end; p += LINE)
        _mm_clflushopt((void *)p);
}

static void lines_clflush(uintptr_t p, uintptr_t end) {
    for (; p < end; p += LINE)
        _mm_clflush((void *)p);
}

/* Write back (and maybe keep) the lines of [d, d + n): no fence. */
static void write_back(const char *d, size_t n) {
    if (n == 0)
        return;
    uintptr_t p = (uintptr_t)d & ~(LINE - 1), end = (uintptr_t)d + n;
    if (have_clwb)
        lines_clwb(p, end);
    else if (have_clflushopt)
        lines_clflushopt(p, end);
    else
        lines_clflush(p, end);
}

/* Evict the lines of [d, d + n), then mfence: later loads read memory. */
static void evict(const char *d, size_t n) {
    uintptr_t p = (uintptr_t)d & ~(LINE - 1), end = (uintptr_t)d + n;
    if (n && have_clflushopt)
        lines_clflushopt(p, end);
    else if (n)
        lines_clflush(p, end);
    _mm_mfence();
}
#endif

/* The steps of a copy; `ctx` is for the recording steps of `plan`. */
struct steps {
    void (*store)(void *ctx, char *d, const char *s, size_t n);
    /* d 128-byte aligned, n a multiple of 128; unfenced. */
    void (*stream)(void *ctx, char *d, const char *s, size_t n);
    void (*write_back)(void *ctx, const char *d, size_t n);
    void (*fence)(void *ctx);
};

/* With wb set (software coherence), the lines written with plain stores are
 * written back, and nothing is fenced: the caller fences once per batch. */
static inline void copy_steps(const struct steps *o, void *ctx, char *d, const char *s, size_t n, int wb) {
    if (STREAMING && n >= (wb ? STORE_STREAM_MIN : STREAM_MIN)) {
        /* Streaming stores need an aligned destination: plain stores for the
         * head up to the next 128-byte boundary and the tail after the last
         * full block. */
        size_t head = (128 - ((uintptr_t)d & 127)) & 127;
        head = head < n ? head : n;
        size_t body = (n - head) & ~(size_t)127;
        o->store(ctx, d, s, head);
        o->stream(ctx, d + head, s + head, body);
        /* Streaming stores are weakly ordered: fence them before the caller
         * publishes the object (commit), so readers never see stale bytes. */
        if (!wb)
            o->fence(ctx);
        o->store(ctx, d + head + body, s + head + body, n - head - body);
        if (wb) {
            o->write_back(ctx, d, head);
            o->write_back(ctx, d + head + body, n - head - body);
        }
        return;
    }
    o->store(ctx, d, s, n);
    if (wb)
        o->write_back(ctx, d, n);
}

static void cpu_store(void *ctx, char *d, const char *s, size_t n) {
    (void)ctx;
    memcpy(d, s, n);
}

#if STREAMING
static void cpu_stream(void *ctx, char *d, const char *s, size_t n) {
    (void)ctx;
    if (have_avx2)
        stream_avx2(d, s, n);
    else
        stream_sse2(d, s, n);
}

static void cpu_write_back(void *ctx, const char *d, size_t n) {
    (void)ctx;
    write_back(d, n);
}

static void cpu_fence(void *ctx) {
    (void)ctx;
    _mm_sfence();
}

static const struct steps CPU = {cpu_store, cpu_stream, cpu_write_back, cpu_fence};
#else
static const struct steps CPU = {cpu_store, NULL, NULL, NULL};
#endif

static void copy(char *d, const char *s, size_t n, int wb) {
    copy_steps(&CPU, NULL, d, s, n, wb);
}

/* `plan`: each step becomes (name, offset from the destination, length). */
struct record {
    PyObject *list;
    const char *base;
    int failed;
};

static void put(struct record *r, const char *name, const char *d, size_t n) {
    if (r->failed || (n == 0 && strcmp(name, "fence") != 0))
        return;
    PyObject *t = Py_BuildValue("(snn)", name, (Py_ssize_t)(d - r->base), (Py_ssize_t)n);
    if (t == NULL || PyList_Append(r->list, t) < 0)
        r->failed = 1;
    Py_XDECREF(t);
}

static void rec_store(void *ctx, char *d, const char *s, size_t n) {
    (void)s;
    put(ctx, "store", d, n);
}

static void rec_stream(void *ctx, char *d, const char *s, size_t n) {
    (void)s;
    put(ctx, "stream", d, n);
}

static void rec_write_back(void *ctx, const char *d, size_t n) {
    put(ctx, "write_back", d, n);
}

static void rec_fence(void *ctx) {
    struct record *r = ctx;
    put(r, "fence", r->base, 0);
}

static const struct steps RECORD = {rec_store, rec_stream, rec_write_back, rec_fence};

static PyObject *py_plan(PyObject *self, PyObject *args) {
    unsigned long long dst;
    Py_ssize_t n;
    int wb;
    (void)self;
    if (!PyArg_ParseTuple(args, "Knp:plan", &dst, &n, &wb))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "plan: negative length");
        return NULL;
    }
    struct record r = {PyList_New(0), (const char *)(uintptr_t)dst, 0};
    if (r.list == NULL)
        return NULL;
    /* Nothing is read or written: the steps only record. */
    copy_steps(&RECORD, &r, (char *)(uintptr_t)dst, NULL, (size_t)n, wb);
    if (r.failed) {
        Py_DECREF(r.list);
        return NULL;
    }
    return r.list;
}

static PyObject *do_copy(PyObject *args, const char *fmt, int wb) {
    unsigned long long dst, src;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, fmt, &dst, &src, &n))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy: negative length");
        return NULL;
    }
    if (n > 0 && (dst == 0 || src == 0)) {
        PyErr_SetString(PyExc_ValueError, "copy: null address");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    copy((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)n, wb);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_copy(PyObject *self, PyObject *args) {
    (void)self;
    return do_copy(args, "KKn:copy", 0);
}

#if STREAMING
static PyObject *py_store(PyObject *self, PyObject *args) {
    (void)self;
    return do_copy(args, "KKn:store", 1);
}

static PyObject *py_fence(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    _mm_sfence();
    Py_RETURN_NONE;
}

static PyObject *py_invalidate(PyObject *self, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kn:invalidate", &addr, &n))
        return NULL;
    if (n < 0 || (n > 0 && addr == 0)) {
        PyErr_SetString(PyExc_ValueError, "invalidate: bad range");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    evict((const char *)(uintptr_t)addr, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
#endif

static PyMethodDef methods[] = {
    {"plan", py_plan, METH_VARARGS,
     "plan(dst, n, write_back): the steps copy (False) or store (True) would take for n bytes"
     " to dst, as (step, offset, length) tuples; nothing is copied."},
    {"copy", py_copy, METH_VARARGS,
     "copy(dst, src, n): copy n bytes between non-overlapping buffers (GIL released);"
     " streaming stores for large copies."},
#if STREAMING
    {"store", py_store, METH_VARARGS,
     "store(dst, src, n): copy, then write back every line written with plain stores"
     " (for pools that are not cache-coherent); call fence() before publishing."},
    {"fence", py_fence, METH_NOARGS, "fence(): sfence, once per batch of store() calls, before Commit."},
    {"invalidate", py_invalidate, METH_VARARGS,
     "invalidate(addr, n): evict the cache lines of a range, then mfence, so reads see memory."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#if STREAMING
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
    unsigned int a, b, c, d;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        have_clflushopt = (b >> 23) & 1;
        have_clwb = (b >> 24) & 1;
    }
    const char *kind = have_avx2 ? "streaming-avx2" : "streaming-sse2";
    const char *flush = have_clwb ? "clwb" : have_clflushopt ? "clflushopt" : "clflush";
    if (PyModule_AddStringConstant(m, "FLUSH", flush) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#else
    const char *kind = "memcpy";
#endif
    if (PyModule_AddStringConstant(m, "KIND", kind) < 0 ||
        PyModule_AddIntConstant(m, "STREAM_MIN", (long)STREAM_MIN) < 0 ||
        PyModule_AddIntConstant(m, "STORE_STREAM_MIN", (long)STORE_STREAM_MIN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
