/*
 * md-rpc-seed: fill an rpc-server tensor cache (-c) from a GGUF already on this host.
 *
 * rpc-server names each cached weight tensor by the FNV-1a 64-bit hash of its bytes
 * (ggml-rpc.cpp: fnv_hash, file name "%016" PRIx64, content = the tensor's bytes) and serves a
 * file it finds there as if whole. Writing those files ahead of time means the orchestrator
 * sends only hashes at start. rpc-server never checks a cached file's size, so an entry is
 * only ever put in place complete: written under a temporary name, fsynced, size-checked,
 * renamed.
 *
 * The cache directory belongs to rpc-server's user (network-facing, so untrusted), and this
 * program may run as root. It opens the directory once, refusing a symbolic link, and does
 * every entry operation relative to that descriptor: a temporary is created exclusively
 * (O_EXCL|O_NOFOLLOW) after unlinking whatever holds its name, an entry is replaced by rename,
 * and a name that is a symbolic link or not a regular file counts as no entry. Nothing it
 * writes can land outside the directory, and nothing there is followed.
 *
 * The GGUF is read with pread, not mapped: a file that shrinks while it is read ends the run
 * with an error (a mapping would die of SIGBUS), and so does one whose size or modification
 * time, checked after each range is read and before its answer is given, differs from when it
 * was opened.
 *
 * A worker without the GGUF can instead fetch each tensor's byte range from another host's
 * verified copy (--digest there lists FNV and SHA-256 per range; --receive here caches one
 * fetched range). The entry's name is only an FNV hash, which anyone can collide, so --receive
 * puts nothing in place unless the size, the FNV and the SHA-256 all match.
 *
 *   md-rpc-seed [--verify] GGUF CACHE_DIR < list     one "<offset> <size>" per line (decimal
 *                                                     digits, one space; a blank line is skipped)
 *   md-rpc-seed --hash FILE OFFSET SIZE               print the hash of one byte range
 *   md-rpc-seed --digest GGUF < list                  "<offset> <size> <16hex> <sha256>" each
 *   md-rpc-seed --receive CACHE_DIR SIZE FNV16 SHA256 < bytes
 *
 * Seed output per tensor: "<16hex> <size> <kept|written>"; --receive prints
 * "<16hex> <size> written". Exit status 0 only when every tensor has a complete entry
 * (--digest: when every line was answered); 2 for bad arguments.
 *
 * Build: cc -O2 -o md-rpc-seed md-rpc-seed.c   (C99, POSIX, no other dependency)
 */
#define _FILE_OFFSET_BITS 64
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define FNV_BASIS 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL
/* Read the source in windows of this many bytes, each hashed (and copied) while it is still in
 * the CPU's cache. Tests build with a tiny one (-DWINDOW=...) to cross many window edges. */
#ifndef WINDOW
#define WINDOW ((size_t)256 << 10)
#endif
/* The longest list line read: "<offset> <size>" as the callers write it takes at most 41
 * characters (two 20-digit numbers and a space); a longer line is refused whole. */
#define LINE_MAX_CHARS 64
#define STR_(x) #x
#define STR(x) STR_(x)

static const char *prog = "md-rpc-seed";

static void die(const char *what, const char *path)
{
    if (path)
        fprintf(stderr, "%s: %s %s: %s\n", prog, what, path, strerror(errno));
    else
        fprintf(stderr, "%s: %s\n", prog, what);
    exit(1);
}

static uint64_t fnv1a(uint64_t h, const unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= FNV_PRIME;
    }
    return h;
}

/* SHA-256 (FIPS 180-4). Written out here because the program may depend on libc only. */
struct sha256 {
    uint32_t h[8];
    uint64_t len; /* bytes taken so far */
    unsigned char buf[64];
    size_t fill; /* bytes of buf waiting for a whole block */
};

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
/* Ch and Maj with one operation fewer than the standard's text; same truth tables. */
#define CH(x, y, z) ((z) ^ ((x) & ((y) ^ (z))))
#define MAJ(x, y, z) (((x) & (y)) | ((z) & ((x) | (y))))
#define BSIG0(x) (ROTR(x, 2) ^ ROTR(x, 13) ^ ROTR(x, 22))
#define BSIG1(x) (ROTR(x, 6) ^ ROTR(x, 11) ^ ROTR(x, 25))
#define SSIG0(x) (ROTR(x, 7) ^ ROTR(x, 18) ^ ((x) >> 3))
#define SSIG1(x) (ROTR(x, 17) ^ ROTR(x, 19) ^ ((x) >> 10))
/* Rounds name the working variables in rotation rather than shifting eight values each
 * round; w keeps only the last 16 schedule words. A block has 64 rounds and 64 bytes, so round
 * i also takes FNV over byte i when asked: FNV is a chain of dependent multiplies, a round
 * another chain, and side by side they overlap (both hashes cost about what SHA-256 alone
 * does, a third less than one after the other). */
#define SHA_ROUND(a, b, c, d, e, f, g, h, i)                                   \
    do {                                                                        \
        uint32_t t1 = h + BSIG1(e) + CH(e, f, g) + K256[i] + w[(i) & 15];       \
        if (fnv)                                                                \
            fh = (fh ^ p[i]) * FNV_PRIME;                                       \
        d += t1;                                                                \
        h = t1 + BSIG0(a) + MAJ(a, b, c);                                       \
    } while (0)
#define SHA_SCHED(i)                                                            \
    (w[(i) & 15] += SSIG1(w[((i) - 2) & 15]) + w[((i) - 7) & 15] +              \
                    SSIG0(w[((i) - 15) & 15]))
#define SHA_EIGHT(i)                                                            \
    do {                                                                        \
        SHA_ROUND(a, b, c, d, e, f, g, h, (i));                                 \
        SHA_ROUND(h, a, b, c, d, e, f, g, (i) + 1);                             \
        SHA_ROUND(g, h, a, b, c, d, e, f, (i) + 2);                             \
        SHA_ROUND(f, g, h, a, b, c, d, e, (i) + 3);                             \
        SHA_ROUND(e, f, g, h, a, b, c, d, (i) + 4);                             \
        SHA_ROUND(d, e, f, g, h, a, b, c, (i) + 5);                             \
        SHA_ROUND(c, d, e, f, g, h, a, b, (i) + 6);                             \
        SHA_ROUND(b, c, d, e, f, g, h, a, (i) + 7);                             \
    } while (0)

static uint32_t load_be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static void store_be32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

/* Compress n whole 64-byte blocks read in place (no alignment needed: loads are bytewise);
 * with fnv, also run FNV-1a over them. */
static void sha256_blocks_c(uint32_t st[8], const unsigned char *p, size_t n, uint64_t *fnv)
{
    uint32_t w[16];
    uint64_t fh = fnv ? *fnv : 0;
    for (; n; n--, p += 64) {
        uint32_t a = st[0], b = st[1], c = st[2], d = st[3];
        uint32_t e = st[4], f = st[5], g = st[6], h = st[7];
        for (int i = 0; i < 16; i++)
            w[i] = load_be32(p + 4 * i);
        SHA_EIGHT(0);
        SHA_EIGHT(8);
        for (int i = 16; i < 64; i += 8) {
            SHA_SCHED(i);
            SHA_SCHED(i + 1);
            SHA_SCHED(i + 2);
            SHA_SCHED(i + 3);
            SHA_SCHED(i + 4);
            SHA_SCHED(i + 5);
            SHA_SCHED(i + 6);
            SHA_SCHED(i + 7);
            SHA_EIGHT(i);
        }
        st[0] += a;
        st[1] += b;
        st[2] += c;
        st[3] += d;
        st[4] += e;
        st[5] += f;
        st[6] += g;
        st[7] += h;
    }
    if (fnv)
        *fnv = fh;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define SHA_NI_BUILT 1

/* The same compression with the SHA extensions (Intel since Goldmont/Ice Lake, AMD since
 * Zen): about five times the portable code. State is kept as ABEF/CDGH, as sha256rnds2
 * wants it; each step of the loop does four rounds and schedules the words four steps on. */
__attribute__((target("sha,sse4.1,ssse3")))
static void sha256_blocks_ni(uint32_t st[8], const unsigned char *p, size_t n)
{
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i t = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&st[0]), 0xB1); /* CDAB */
    __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&st[4]), 0x1B); /* EFGH */
    __m128i s0 = _mm_alignr_epi8(t, s1, 8);                                       /* ABEF */
    s1 = _mm_blend_epi16(s1, t, 0xF0);                                             /* CDGH */
    for (; n; n--, p += 64) {
        __m128i abef = s0, cdgh = s1, m[4];
        for (int j = 0; j < 4; j++)
            m[j] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * j)), swap);
        for (int j = 0; j < 16; j++) {
            __m128i k = _mm_add_epi32(m[j & 3], _mm_loadu_si128((const __m128i *)&K256[4 * j]));
            s1 = _mm_sha256rnds2_epu32(s1, s0, k);
            s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(k, 0x0E));
            if (j < 12) { /* W[j+4] from W[j..j+3], in the slot W[j] leaves */
                __m128i w = _mm_sha256msg1_epu32(m[j & 3], m[(j + 1) & 3]);
                w = _mm_add_epi32(w, _mm_alignr_epi8(m[(j + 3) & 3], m[(j + 2) & 3], 4));
                m[j & 3] = _mm_sha256msg2_epu32(w, m[(j + 3) & 3]);
            }
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
    }
    t = _mm_shuffle_epi32(s0, 0x1B);                                     /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);                                    /* DCHG */
    _mm_storeu_si128((__m128i *)&st[0], _mm_blend_epi16(t, s1, 0xF0));  /* DCBA */
    _mm_storeu_si128((__m128i *)&st[4], _mm_alignr_epi8(s1, t, 8));     /* HGFE */
}

/* Whether this CPU has them (CPUID leaf 7 EBX bit 29; SSE4.1 and SSSE3 in leaf 1 ECX).
 * MD_RPC_SEED_PORTABLE=1 in the environment forces the portable code (tests compare both). */
static int sha_ni(void)
{
    static int known = -1;
    if (known < 0) {
        unsigned a, b, c, d;
        const char *env = getenv("MD_RPC_SEED_PORTABLE");
        known = !(env && strcmp(env, "1") == 0) && __get_cpuid(1, &a, &b, &c, &d) &&
                (c & (1u << 19)) && (c & (1u << 9)) && __get_cpuid_count(7, 0, &a, &b, &c, &d) &&
                (b & (1u << 29));
    }
    return known;
}
#endif

static void sha256_blocks(uint32_t st[8], const unsigned char *p, size_t n, uint64_t *fnv)
{
#ifdef SHA_NI_BUILT
    if (sha_ni()) {
        /* FNV then SHA over the same 64 bytes, still in L1: one pass over memory. */
        for (; n; n--, p += 64) {
            if (fnv)
                *fnv = fnv1a(*fnv, p, 64);
            sha256_blocks_ni(st, p, 1);
        }
        return;
    }
#endif
    sha256_blocks_c(st, p, n, fnv);
}

static void sha256_init(struct sha256 *s)
{
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, iv, sizeof iv);
    s->len = 0;
    s->fill = 0;
}

static void sha256_update(struct sha256 *s, const unsigned char *p, size_t n)
{
    s->len += n;
    if (s->fill) {
        size_t k = 64 - s->fill < n ? 64 - s->fill : n;
        memcpy(s->buf + s->fill, p, k);
        s->fill += k;
        p += k;
        n -= k;
        if (s->fill < 64)
            return;
        sha256_blocks(s->h, s->buf, 1, NULL);
        s->fill = 0;
    }
    /* Whole blocks straight from the caller's buffer: copying them first would cost a pass. */
    sha256_blocks(s->h, p, n / 64, NULL);
    p += n - n % 64;
    n %= 64;
    memcpy(s->buf, p, n);
    s->fill = n;
}

static void sha256_final(struct sha256 *s, unsigned char out[32])
{
    uint64_t bits = s->len * 8;
    s->buf[s->fill++] = 0x80;
    if (s->fill > 56) {
        memset(s->buf + s->fill, 0, 64 - s->fill);
        sha256_blocks(s->h, s->buf, 1, NULL);
        s->fill = 0;
    }
    memset(s->buf + s->fill, 0, 56 - s->fill);
    store_be32(s->buf + 56, (uint32_t)(bits >> 32));
    store_be32(s->buf + 60, (uint32_t)bits);
    sha256_blocks(s->h, s->buf, 1, NULL);
    for (int i = 0; i < 8; i++)
        store_be32(out + 4 * i, s->h[i]);
}

static void sha256_hex(const unsigned char d[32], char hex[65])
{
    for (int i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", d[i]);
}

/* FNV-1a and SHA-256 over one buffer in one pass: the bytes that complete a block pending in
 * sha and the tail that starts the next go separately, every whole block in between through
 * the fused rounds. */
static uint64_t fnv1a_sha256(uint64_t h, struct sha256 *sha, const unsigned char *p, size_t n)
{
    size_t head = sha->fill ? 64 - sha->fill : 0;
    if (head > n)
        head = n;
    h = fnv1a(h, p, head);
    sha256_update(sha, p, head);
    p += head;
    n -= head;
    /* Here either nothing is pending in sha or nothing is left of p. */
    size_t whole = n - n % 64;
    sha256_blocks(sha->h, p, whole / 64, &h);
    sha->len += whole;
    h = fnv1a(h, p + whole, n - whole);
    sha256_update(sha, p + whole, n - whole);
    return h;
}

/* What hash_range and the checks after it report besides 0. */
enum { READ_ERROR = -1, SOURCE_ENDED = -2, WRITE_ERROR = -3 };

/* n bytes of fd at offset into buf: 0, or READ_ERROR, or SOURCE_ENDED when the file ends
 * first. */
static int read_at(int fd, unsigned char *buf, size_t n, uint64_t offset)
{
    for (size_t got = 0; got < n;) {
        ssize_t r = pread(fd, buf + got, n - got, (off_t)(offset + got));
        if (r < 0 && errno != EINTR)
            return READ_ERROR;
        if (r == 0)
            return SOURCE_ENDED;
        if (r > 0)
            got += (size_t)r;
    }
    return 0;
}

static int write_all(int fd, const unsigned char *buf, size_t n)
{
    for (size_t w = 0; w < n;) {
        ssize_t r = write(fd, buf + w, n - w);
        if (r < 0 && errno != EINTR)
            return WRITE_ERROR;
        if (r > 0)
            w += (size_t)r;
    }
    return 0;
}

/* Hash [offset, offset+size) of fd; when out >= 0 also copy the bytes there, and when sha is
 * given also feed them to it (in the same pass). pread, not mmap: a file that shrinks under a
 * mapping kills the process with SIGBUS, while pread returns short and the caller can say so. */
static int hash_range(int fd, uint64_t offset, uint64_t size, int out, uint64_t *hash,
                      struct sha256 *sha)
{
    static unsigned char *buf;
    if (!buf) {
        void *p;
        if (posix_memalign(&p, 4096, WINDOW) != 0)
            die("out of memory", NULL);
        buf = p;
    }
    uint64_t h = FNV_BASIS, done = 0;
    while (done < size) {
        size_t n = (size - done) > WINDOW ? WINDOW : (size_t)(size - done);
        int rc = read_at(fd, buf, n, offset + done);
        if (rc < 0)
            return rc;
        h = sha ? fnv1a_sha256(h, sha, buf, n) : fnv1a(h, buf, n);
        if (out >= 0 && (rc = write_all(out, buf, n)) < 0)
            return rc;
        done += n;
    }
    *hash = h;
    return 0;
}

/* The source as it was opened, to tell at the end whether it changed while it was read. */
struct source {
    const char *path;
    int fd;
    struct stat st;
};

#ifdef __APPLE__
#define MTIME_NSEC(st) 0L /* macOS names it otherwise under _POSIX_C_SOURCE; seconds will do */
#else
#define MTIME_NSEC(st) ((long)(st).st_mtim.tv_nsec)
#endif

static void open_source(struct source *src, const char *path)
{
    src->path = path;
    src->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (src->fd < 0 || fstat(src->fd, &src->st) < 0)
        die("cannot open", path);
#ifdef POSIX_FADV_SEQUENTIAL /* not on macOS */
    posix_fadvise(src->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
}

/* After a read of [off, off+size) that returned rc: 0 when it succeeded and the source still has
 * the size and modification time it had when opened; else says what happened and returns 1.
 * Checked before each answer is given, so that an answer read from a file being rewritten
 * (which may be of neither version) is never printed, and the callers, which count answers,
 * stop there. A shrunk file ends a read early (pread returns short, where a mapping would have
 * died of SIGBUS). */
static int source_check(const struct source *src, int rc, uint64_t off, uint64_t size)
{
    struct stat now;
    if (rc == SOURCE_ENDED) {
        fprintf(stderr, "%s: %s changed while it was read: it ends before byte %" PRIu64
                " now (%jd bytes when opened)\n", prog, src->path, off + size,
                (intmax_t)src->st.st_size);
        return 1;
    }
    if (rc < 0 || fstat(src->fd, &now) < 0) {
        fprintf(stderr, "%s: cannot read %s: %s\n", prog, src->path, strerror(errno));
        return 1;
    }
    if (now.st_size != src->st.st_size || now.st_mtime != src->st.st_mtime ||
        MTIME_NSEC(now) != MTIME_NSEC(src->st)) {
        fprintf(stderr, "%s: %s changed while it was read (its size or modification time "
                "differ from when it was opened)\n", prog, src->path);
        return 1;
    }
    return 0;
}

/* A number of decimal digits only (no sign, space or base prefix) that fits 64 bits, from
 * [*p, end); *p moves past it. */
static int parse_digits(const char **p, const char *end, uint64_t *v)
{
    const char *s = *p;
    uint64_t x = 0;
    for (; s < end && *s >= '0' && *s <= '9'; s++) {
        unsigned d = (unsigned)(*s - '0');
        if (x > (UINT64_MAX - d) / 10)
            return -1;
        x = x * 10 + d;
    }
    if (s == *p)
        return -1;
    *p = s;
    *v = x;
    return 0;
}

/* A whole argument as a number (strtoull would take " -1" for 2^64-1). */
static int parse_u64(const char *s, uint64_t *v)
{
    const char *end = s + strlen(s), *p = s;
    return parse_digits(&p, end, v) == 0 && p == end ? 0 : -1;
}

static int hash_mode(const char *path, const char *off_s, const char *size_s)
{
    uint64_t off, size, h;
    struct source src;
    if (parse_u64(off_s, &off) || parse_u64(size_s, &size))
        die("OFFSET and SIZE must be non-negative integers", NULL);
    open_source(&src, path);
    if (off > (uint64_t)src.st.st_size || size > (uint64_t)src.st.st_size - off) {
        fprintf(stderr, "%s: range %" PRIu64 "+%" PRIu64 " is past the end of %s (%jd bytes)\n",
                prog, off, size, path, (intmax_t)src.st.st_size);
        return 1;
    }
    if (source_check(&src, hash_range(src.fd, off, size, -1, &h, NULL), off, size))
        return 1;
    printf("%016" PRIx64 "\n", h);
    return 0;
}

/* One line of stdin into buf without its newline: 1, or 0 at the end of the input, or -1 for a
 * line longer than cap - 1 (read to its end all the same: it is one bad line, not two). */
static int read_line(char *buf, size_t cap, size_t *len)
{
    size_t n = 0;
    int c, over = 0;
    while ((c = getchar()) != EOF && c != '\n') {
        if (n + 1 < cap)
            buf[n++] = (char)c;
        else
            over = 1;
    }
    if (c == EOF && ferror(stdin))
        die("cannot read the tensor list from stdin", NULL);
    buf[n] = '\0';
    *len = n;
    if (c == EOF && n == 0)
        return 0;
    return over ? -1 : 1;
}

/* Next "<offset> <size>" line of stdin, checked against a file of fsize bytes: 1 when one was
 * read, 0 at the end, -1 after saying why not. Shared so that every mode reads a list alike.
 * The callers write exactly "%d %d\n"; anything else is refused whole, with its line number. */
static int next_range(const char *path, off_t fsize, unsigned long *lineno, uint64_t *off,
                      uint64_t *size)
{
    char line[LINE_MAX_CHARS + 1];
    size_t len;
    int got;
    while ((got = read_line(line, sizeof line, &len)) != 0) {
        ++*lineno;
        if (got > 0 && len == 0)
            continue;
        const char *p = line, *end = line + len;
        if (got < 0 || parse_digits(&p, end, off) || p == end || *p++ != ' ' ||
            parse_digits(&p, end, size) || p != end) {
            /* Shown as read, up to the limit; a byte that is not printable ASCII as '?'. */
            for (size_t i = 0; i < len; i++)
                if (line[i] < ' ' || line[i] > '~')
                    line[i] = '?';
            fprintf(stderr, "%s: stdin line %lu: expected \"<offset> <size>\", got: %s%s\n",
                    prog, *lineno, line,
                    got < 0 ? "... (longer than " STR(LINE_MAX_CHARS) " characters)" : "");
            return -1;
        }
        if (*off > (uint64_t)fsize || *size > (uint64_t)fsize - *off) {
            fprintf(stderr, "%s: stdin line %lu: %" PRIu64 "+%" PRIu64 " is past the end of "
                    "%s (%jd bytes): wrong tensor list for this file?\n", prog, *lineno, *off,
                    *size, path, (intmax_t)fsize);
            return -1;
        }
        return 1;
    }
    return 0;
}

/* ---- the cache directory ---------------------------------------------------------------- */

/* CACHE_DIR opened once (O_NOFOLLOW: not through a symbolic link of its own name; a trailing
 * slash would make open follow one, so it is dropped first). Returns the descriptor, or -1
 * with errno set, or -2 when it is a symbolic link. */
static int open_cache_dir(const char *dir)
{
    size_t n = strlen(dir);
    char *p = malloc(n + 1);
    if (!p)
        die("out of memory", NULL);
    memcpy(p, dir, n + 1);
    while (n > 1 && p[n - 1] == '/')
        p[--n] = '\0';
    int fd = open(p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        int saved = errno;
        struct stat st;
        if (lstat(p, &st) == 0 && S_ISLNK(st.st_mode))
            fd = -2;
        errno = saved;
    }
    free(p);
    return fd;
}

/* The renames are durable only once the directory itself is synced. */
static void sync_cache_dir(int dfd, const char *dir)
{
    if (fsync(dfd) < 0 && errno != EINVAL && errno != ENOTSUP)
        die("cannot sync the cache directory", dir);
}

/* An entry being written: the temporary ".<16hex>.tmp" in the cache directory, renamed over
 * "<16hex>" when complete. */
struct entry {
    int dfd, fd;
    const char *dir;
    char name[17], tmp[24];
    dev_t dev;
    ino_t ino;
};

/* Says what failed, about DIR/name (errno's text when errno is set), removes the temporary when
 * it is this run's, and exits 1. */
static void entry_die(struct entry *e, const char *what, const char *name, int remove_tmp)
{
    int saved = errno;
    if (e->fd >= 0)
        close(e->fd);
    if (remove_tmp)
        unlinkat(e->dfd, e->tmp, 0);
    if (saved)
        fprintf(stderr, "%s: %s %s/%s: %s\n", prog, what, e->dir, name, strerror(saved));
    else
        fprintf(stderr, "%s: %s %s/%s\n", prog, what, e->dir, name);
    exit(1);
}

static void entry_create(struct entry *e, int dfd, const char *dir, const char *name16)
{
    struct stat st;
    e->dfd = dfd;
    e->fd = -1;
    e->dir = dir;
    snprintf(e->name, sizeof e->name, "%s", name16);
    snprintf(e->tmp, sizeof e->tmp, ".%s.tmp", name16);
    /* A temporary an interrupted run left, or whatever else holds the name: unlinking a name
     * never follows it, and O_EXCL|O_NOFOLLOW then refuses anything put back in between. */
    if (unlinkat(dfd, e->tmp, 0) < 0 && errno != ENOENT)
        entry_die(e, "cannot remove the stale temporary", e->tmp, 0);
    e->fd = openat(dfd, e->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (e->fd < 0)
        entry_die(e, "cannot create", e->tmp, 0);
    if (fstat(e->fd, &st) < 0)
        entry_die(e, "cannot stat", e->tmp, 1);
    if (!S_ISREG(st.st_mode)) {
        errno = 0;
        entry_die(e, "not a regular file:", e->tmp, 0);
    }
    e->dev = st.st_dev;
    e->ino = st.st_ino;
}

/* Syncs the temporary, checks it holds size bytes and still has its name, renames it over the
 * entry's name (replacing a symbolic link or anything else there, never following it). */
static void entry_commit(struct entry *e, uint64_t size)
{
    struct stat st, now;
    if (fsync(e->fd) < 0 || fstat(e->fd, &st) < 0)
        entry_die(e, "cannot flush", e->tmp, 1);
    int rc = close(e->fd);
    e->fd = -1;
    if (rc < 0)
        entry_die(e, "cannot flush", e->tmp, 1);
    if ((uint64_t)st.st_size != size) {
        unlinkat(e->dfd, e->tmp, 0);
        fprintf(stderr, "%s: %s/%s holds %jd bytes, expected %" PRIu64 "\n", prog, e->dir,
                e->tmp, (intmax_t)st.st_size, size);
        exit(1);
    }
    /* Another writer's file under the same temporary name would go in place of this one. */
    if (fstatat(e->dfd, e->tmp, &now, AT_SYMLINK_NOFOLLOW) < 0 || now.st_dev != e->dev ||
        now.st_ino != e->ino) {
        errno = 0;
        entry_die(e, "the temporary was replaced while it was written:", e->tmp, 0);
    }
    if (renameat(e->dfd, e->tmp, e->dfd, e->name) < 0)
        entry_die(e, "cannot rename into", e->name, 1);
}

/* Whether the cache holds a regular file of size bytes named name (a symbolic link, or anything
 * but a regular file, counts as no entry and is replaced); with verify, also that its bytes
 * hash to want. */
static int entry_present(int dfd, const char *name, uint64_t size, int verify, uint64_t want)
{
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISREG(st.st_mode) ||
        (uint64_t)st.st_size != size)
        return 0;
    if (!verify)
        return 1;
    /* O_NONBLOCK: should a FIFO be swapped in meanwhile, the open must not wait for a writer. */
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return 0;
    uint64_t h;
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size == size &&
             hash_range(fd, 0, size, -1, &h, NULL) == 0 && h == want;
    close(fd);
    return ok;
}

/* ---- modes ------------------------------------------------------------------------------- */

static int seed_mode(const char *gguf, const char *dir, int verify)
{
    struct source src;
    open_source(&src, gguf);
    int dfd = open_cache_dir(dir);
    if (dfd == -2) {
        fprintf(stderr, "%s: cache directory %s is a symbolic link: refused (name the "
                "directory itself)\n", prog, dir);
        exit(1);
    }
    if (dfd < 0)
        die("cache directory", dir);

    unsigned long lineno = 0;
    uint64_t off, size;
    int got;
    while ((got = next_range(gguf, src.st.st_size, &lineno, &off, &size)) > 0) {
        uint64_t h;
        char name[17];
        /* The name is only known after hashing; hash the source first, then decide. */
        if (source_check(&src, hash_range(src.fd, off, size, -1, &h, NULL), off, size))
            return 1;
        snprintf(name, sizeof name, "%016" PRIx64, h);
        int keep = entry_present(dfd, name, size, verify, h);
        if (!keep) {
            struct entry e;
            uint64_t wh = 0;
            entry_create(&e, dfd, dir, name);
            int rc = hash_range(src.fd, off, size, e.fd, &wh, NULL);
            if (rc == WRITE_ERROR)
                entry_die(&e, "cannot copy tensor bytes into", e.tmp, 1);
            if (source_check(&src, rc, off, size)) {
                close(e.fd);
                unlinkat(dfd, e.tmp, 0);
                return 1;
            }
            if (wh != h) {
                close(e.fd);
                unlinkat(dfd, e.tmp, 0);
                fprintf(stderr, "%s: %s changed while being read (hash %016" PRIx64
                        " then %016" PRIx64 ")\n", prog, gguf, h, wh);
                return 1;
            }
            entry_commit(&e, size);
        }
        printf("%016" PRIx64 " %" PRIu64 " %s\n", h, size, keep ? "kept" : "written");
        fflush(stdout);
    }
    if (got < 0)
        return 1;
    sync_cache_dir(dfd, dir);
    close(dfd);
    close(src.fd);
    return 0;
}

/* What a host with the verified GGUF publishes, so that a worker fetching only byte ranges
 * can check each one before caching it. */
static int digest_mode(const char *gguf)
{
    struct source src;
    open_source(&src, gguf);
    unsigned long lineno = 0;
    uint64_t off, size;
    int got;
    while ((got = next_range(gguf, src.st.st_size, &lineno, &off, &size)) > 0) {
        uint64_t h;
        struct sha256 sha;
        unsigned char d[32];
        char hex[65];
        sha256_init(&sha);
        if (source_check(&src, hash_range(src.fd, off, size, -1, &h, &sha), off, size))
            return 1;
        sha256_final(&sha, d);
        sha256_hex(d, hex);
        printf("%" PRIu64 " %" PRIu64 " %016" PRIx64 " %s\n", off, size, h, hex);
        fflush(stdout);
    }
    close(src.fd);
    return got < 0;
}

static int is_lower_hex(const char *s, size_t len)
{
    size_t i = 0;
    for (; s[i]; i++)
        if (i >= len || !((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return i == len;
}

static ssize_t read_some(int fd, unsigned char *buf, size_t n)
{
    ssize_t r;
    do
        r = read(fd, buf, n);
    while (r < 0 && errno == EINTR);
    return r;
}

/* Cache one tensor whose bytes come on stdin (a fetch of its range from another host). The
 * hashes are taken from the stream, not re-read from the file, so that what is checked is what
 * was written; the bytes go only into this run's own temporary (created O_EXCL), which is
 * renamed into place only when size, FNV and SHA-256 all match. */
static int receive_mode(int dfd, const char *dir, uint64_t size, const char *want_fnv,
                        const char *want_sha)
{
    const size_t bufsize = (size_t)1 << 20;
    unsigned char *buf = malloc(bufsize);
    if (!buf)
        die("out of memory", NULL);
    struct entry e;
    entry_create(&e, dfd, dir, want_fnv);

    uint64_t h = FNV_BASIS, got = 0;
    struct sha256 sha;
    sha256_init(&sha);
    while (got < size) {
        size_t want = size - got < bufsize ? (size_t)(size - got) : bufsize;
        ssize_t r = read_some(STDIN_FILENO, buf, want);
        if (r < 0)
            entry_die(&e, "cannot read stdin for", e.tmp, 1);
        if (r == 0)
            break;
        h = fnv1a_sha256(h, &sha, buf, (size_t)r);
        for (ssize_t w = 0; w < r;) {
            ssize_t k = write(e.fd, buf + w, (size_t)(r - w));
            if (k < 0 && errno != EINTR)
                entry_die(&e, "cannot write", e.tmp, 1);
            if (k > 0)
                w += k;
        }
        got += (uint64_t)r;
    }
    /* A longer stream is a different range (or a different file) even if its first SIZE bytes
     * happen to match. */
    int more = 0;
    if (got == size) {
        ssize_t r = read_some(STDIN_FILENO, buf, 1);
        if (r < 0)
            entry_die(&e, "cannot read stdin for", e.tmp, 1);
        more = r > 0;
    }
    unsigned char d[32];
    char fnv_hex[17], sha_hex[65];
    sha256_final(&sha, d);
    sha256_hex(d, sha_hex);
    snprintf(fnv_hex, sizeof fnv_hex, "%016" PRIx64, h);
    int bad_fnv = strcmp(fnv_hex, want_fnv) != 0, bad_sha = strcmp(sha_hex, want_sha) != 0;
    if (got != size || more || bad_fnv || bad_sha) {
        close(e.fd);
        unlinkat(dfd, e.tmp, 0);
        if (got < size)
            fprintf(stderr, "%s: received %" PRIu64 " bytes, expected %" PRIu64 " (the input "
                    "ended early)\n", prog, got, size);
        else if (more)
            fprintf(stderr, "%s: received more than the expected %" PRIu64 " bytes\n", prog,
                    size);
        else {
            if (bad_fnv)
                fprintf(stderr, "%s: FNV-1a of the %" PRIu64 " bytes received is %s, expected "
                        "%s\n", prog, got, fnv_hex, want_fnv);
            if (bad_sha)
                fprintf(stderr, "%s: SHA-256 of the %" PRIu64 " bytes received is %s, expected "
                        "%s\n", prog, got, sha_hex, want_sha);
        }
        fprintf(stderr, "%s: nothing cached for %s\n", prog, want_fnv);
        return 1;
    }
    entry_commit(&e, size);
    sync_cache_dir(dfd, dir);
    printf("%s %" PRIu64 " written\n", want_fnv, size);
    free(buf);
    close(dfd);
    return 0;
}

static void usage(void)
{
    fprintf(stderr, "usage: %s [--verify] GGUF CACHE_DIR < list   (\"<offset> <size>\" lines)\n"
                    "       %s --hash FILE OFFSET SIZE\n"
                    "       %s --digest GGUF < list   (prints \"<offset> <size> <fnv16> "
                    "<sha256>\")\n"
                    "       %s --receive CACHE_DIR SIZE FNV16 SHA256 < bytes\n",
            prog, prog, prog, prog);
}

/* Checked before anything is created, so that a bad call exits 2 and leaves no trace. */
static int receive_args(char **argv)
{
    uint64_t size;
    const char *why = NULL;
    int dfd = open_cache_dir(argv[2]);
    if (dfd == -2)
        why = "CACHE_DIR must be the directory itself, not a symbolic link";
    else if (dfd < 0)
        why = "CACHE_DIR must be an existing directory";
    else if (parse_u64(argv[3], &size))
        why = "SIZE must be a non-negative integer";
    else if (!is_lower_hex(argv[4], 16))
        why = "FNV16 must be 16 lowercase hex digits";
    else if (!is_lower_hex(argv[5], 64))
        why = "SHA256 must be 64 lowercase hex digits";
    if (why) {
        fprintf(stderr, "%s: --receive: %s\n", prog, why);
        usage();
        return 2;
    }
    return receive_mode(dfd, argv[2], size, argv[4], argv[5]);
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "--hash") == 0)
        return hash_mode(argv[2], argv[3], argv[4]);
    if (argc == 3 && strcmp(argv[1], "--digest") == 0)
        return digest_mode(argv[2]);
    if (argc == 6 && strcmp(argv[1], "--receive") == 0)
        return receive_args(argv);
    if (argc == 4 && strcmp(argv[1], "--verify") == 0)
        return seed_mode(argv[2], argv[3], 1);
    if (argc == 3 && argv[1][0] != '-')
        return seed_mode(argv[1], argv[2], 0);
    usage();
    return 2;
}
