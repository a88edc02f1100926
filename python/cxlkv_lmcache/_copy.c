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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

/* Below this, the destination is likely read again soon and fits in cache. */
#define STREAM_MIN ((size_t)512 << 10)

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

static int have_avx2;
#endif

static void copy(char *d, const char *s, size_t n) {
#if STREAMING
    if (n >= STREAM_MIN) {
        /* Streaming stores need an aligned destination: memcpy the head up to
         * the next 128-byte boundary and the tail after the last full block. */
        size_t head = (128 - ((uintptr_t)d & 127)) & 127;
        memcpy(d, s, head);
        size_t body = (n - head) & ~(size_t)127;
        if (have_avx2)
            stream_avx2(d + head, s + head, body);
        else
            stream_sse2(d + head, s + head, body);
        /* Streaming stores are weakly ordered: fence them before the caller
         * publishes the object (commit), so readers never see stale bytes. */
        _mm_sfence();
        memcpy(d + head + body, s + head + body, n - head - body);
        return;
    }
#endif
    memcpy(d, s, n);
}

static PyObject *py_copy(PyObject *self, PyObject *args) {
    unsigned long long dst, src;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKn:copy", &dst, &src, &n))
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
    copy((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", py_copy, METH_VARARGS,
     "copy(dst, src, n): copy n bytes between non-overlapping buffers (GIL released);"
     " streaming stores for large copies."},
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
    const char *kind = have_avx2 ? "streaming-avx2" : "streaming-sse2";
#else
    const char *kind = "memcpy";
#endif
    if (PyModule_AddStringConstant(m, "KIND", kind) < 0 ||
        PyModule_AddIntConstant(m, "STREAM_MIN", (long)STREAM_MIN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
