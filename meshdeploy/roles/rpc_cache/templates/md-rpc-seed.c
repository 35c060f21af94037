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
 * A worker without the GGUF can instead fetch each tensor's byte range from another host's
 * verified copy (--digest there lists FNV and SHA-256 per range; --receive here caches one
 * fetched range). The entry's name is only an FNV hash, which anyone can collide, so --receive
 * puts nothing in place unless the size, the FNV and the SHA-256 all match.
 *
 *   md-rpc-seed [--verify] GGUF CACHE_DIR < list     one "<offset> <size>" per line
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
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define FNV_BASIS 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL
/* Map the source in windows: a 32-bit host cannot map a multi-GB GGUF at once. Tests build
 * with a tiny one (-DWINDOW=...) to cross window edges without a file of gigabytes. */
#ifndef WINDOW
#define WINDOW ((size_t)256 << 20)
#endif

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

/* Hash [offset, offset+size) of fd; when out >= 0 also copy the bytes there, and when sha is
 * given also feed them to it (in the same pass). */
static int hash_range(int fd, uint64_t offset, uint64_t size, int out, uint64_t *hash,
                      struct sha256 *sha)
{
    long page = sysconf(_SC_PAGESIZE);
    uint64_t h = FNV_BASIS, done = 0;
    while (done < size) {
        uint64_t pos = offset + done;
        uint64_t base = pos - pos % (uint64_t)page;
        size_t lead = (size_t)(pos - base);
        size_t n = (size - done) > WINDOW ? WINDOW : (size_t)(size - done);
        unsigned char *m = mmap(NULL, lead + n, PROT_READ, MAP_SHARED, fd, (off_t)base);
        if (m == MAP_FAILED)
            return -1;
        posix_madvise(m, lead + n, POSIX_MADV_SEQUENTIAL);
        h = sha ? fnv1a_sha256(h, sha, m + lead, n) : fnv1a(h, m + lead, n);
        if (out >= 0) {
            size_t w = 0;
            while (w < n) {
                ssize_t r = write(out, m + lead + w, n - w);
                if (r < 0) {
                    if (errno == EINTR)
                        continue;
                    munmap(m, lead + n);
                    return -1;
                }
                w += (size_t)r;
            }
        }
        munmap(m, lead + n);
        done += n;
    }
    *hash = h;
    return 0;
}

static int file_hash(const char *path, uint64_t size, uint64_t *hash)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return -1;
    int rc = hash_range(fd, 0, size, -1, hash, NULL);
    int saved = errno;
    close(fd);
    errno = saved;
    return rc;
}

static int parse_u64(const char *s, uint64_t *v)
{
    char *end;
    errno = 0;
    unsigned long long x = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-')
        return -1;
    *v = (uint64_t)x;
    return 0;
}

static int hash_mode(const char *path, const char *off_s, const char *size_s)
{
    uint64_t off, size, h;
    struct stat st;
    if (parse_u64(off_s, &off) || parse_u64(size_s, &size))
        die("OFFSET and SIZE must be non-negative integers", NULL);
    int fd = open(path, O_RDONLY);
    if (fd < 0 || fstat(fd, &st) < 0)
        die("cannot open", path);
    if (off > (uint64_t)st.st_size || size > (uint64_t)st.st_size - off) {
        fprintf(stderr, "%s: range %" PRIu64 "+%" PRIu64 " is past the end of %s (%jd bytes)\n",
                prog, off, size, path, (intmax_t)st.st_size);
        return 1;
    }
    if (hash_range(fd, off, size, -1, &h, NULL) < 0)
        die("cannot read", path);
    printf("%016" PRIx64 "\n", h);
    return 0;
}

/* Next "<offset> <size>" line of stdin, checked against a file of fsize bytes: 1 when one was
 * read, 0 at the end, -1 after saying why not. Shared so that every mode reads a list alike. */
static int next_range(const char *path, off_t fsize, unsigned long *lineno, uint64_t *off,
                      uint64_t *size)
{
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        ++*lineno;
        char a[64], b[64], extra[2];
        if (line[0] == '\n' || line[0] == '\0')
            continue;
        int n = sscanf(line, "%63s %63s %1s", a, b, extra);
        if (n != 2 || parse_u64(a, off) || parse_u64(b, size)) {
            fprintf(stderr, "%s: stdin line %lu: expected \"<offset> <size>\", got: %s", prog,
                    *lineno, line);
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
    if (ferror(stdin))
        die("cannot read the tensor list from stdin", NULL);
    return 0;
}

/* Copy one tensor into tmp (hashing it again on the way); exits with a message on error. */
static void write_entry(int src, const char *dir, uint64_t off, uint64_t size, uint64_t name,
                        uint64_t *hash, char *tmp, size_t tmplen)
{
    snprintf(tmp, tmplen, "%s/.%016" PRIx64 ".tmp", dir, name);
    int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0)
        die("cannot create", tmp);
    if (hash_range(src, off, size, out, hash, NULL) < 0) {
        int saved = errno;
        unlink(tmp);
        errno = saved;
        die("cannot copy tensor bytes into", tmp);
    }
    struct stat st;
    if (fsync(out) < 0 || fstat(out, &st) < 0 || close(out) < 0) {
        int saved = errno;
        unlink(tmp);
        errno = saved;
        die("cannot flush", tmp);
    }
    if ((uint64_t)st.st_size != size) {
        unlink(tmp);
        fprintf(stderr, "%s: %s holds %jd bytes, expected %" PRIu64 "\n", prog, tmp,
                (intmax_t)st.st_size, size);
        exit(1);
    }
}

static int seed_mode(const char *gguf, const char *dir, int verify)
{
    struct stat gst;
    int src = open(gguf, O_RDONLY);
    if (src < 0 || fstat(src, &gst) < 0)
        die("cannot open", gguf);
    struct stat dst;
    if (stat(dir, &dst) < 0 || !S_ISDIR(dst.st_mode)) {
        if (errno == 0)
            errno = ENOTDIR;
        die("cache directory", dir);
    }
    size_t plen = strlen(dir) + 64;
    char *tmp = malloc(plen), *final = malloc(plen);
    if (!tmp || !final)
        die("out of memory", NULL);

    unsigned long lineno = 0;
    uint64_t off, size;
    int got;
    while ((got = next_range(gguf, gst.st_size, &lineno, &off, &size)) > 0) {
        uint64_t h;
        /* The name is only known after hashing; hash the source first, then decide. */
        if (hash_range(src, off, size, -1, &h, NULL) < 0)
            die("cannot read", gguf);
        snprintf(final, plen, "%s/%016" PRIx64, dir, h);
        struct stat est;
        int keep = stat(final, &est) == 0 && S_ISREG(est.st_mode) &&
                   (uint64_t)est.st_size == size;
        if (keep && verify) {
            uint64_t eh;
            keep = file_hash(final, size, &eh) == 0 && eh == h;
        }
        if (!keep) {
            uint64_t wh;
            write_entry(src, dir, off, size, h, &wh, tmp, plen);
            if (wh != h) {
                unlink(tmp);
                fprintf(stderr, "%s: %s changed while being read (hash %016" PRIx64
                        " then %016" PRIx64 ")\n", prog, gguf, h, wh);
                return 1;
            }
            if (rename(tmp, final) < 0) {
                int saved = errno;
                unlink(tmp);
                errno = saved;
                die("cannot rename into", final);
            }
        }
        printf("%016" PRIx64 " %" PRIu64 " %s\n", h, size, keep ? "kept" : "written");
        fflush(stdout);
    }
    if (got < 0)
        return 1;
    /* The renames are durable only once the directory itself is synced. */
    int dfd = open(dir, O_RDONLY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    free(tmp);
    free(final);
    close(src);
    return 0;
}

/* What a host with the verified GGUF publishes, so that a worker fetching only byte ranges
 * can check each one before caching it. */
static int digest_mode(const char *gguf)
{
    struct stat gst;
    int src = open(gguf, O_RDONLY);
    if (src < 0 || fstat(src, &gst) < 0)
        die("cannot open", gguf);
    unsigned long lineno = 0;
    uint64_t off, size;
    int got;
    while ((got = next_range(gguf, gst.st_size, &lineno, &off, &size)) > 0) {
        uint64_t h;
        struct sha256 sha;
        unsigned char d[32];
        char hex[65];
        sha256_init(&sha);
        if (hash_range(src, off, size, -1, &h, &sha) < 0)
            die("cannot read", gguf);
        sha256_final(&sha, d);
        sha256_hex(d, hex);
        printf("%" PRIu64 " %" PRIu64 " %016" PRIx64 " %s\n", off, size, h, hex);
        fflush(stdout);
    }
    close(src);
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

static void fail_receive(const char *tmp, const char *what, const char *path)
{
    int saved = errno;
    unlink(tmp);
    errno = saved;
    die(what, path);
}

/* Cache one tensor whose bytes come on stdin (a fetch of its range from another host). The
 * hashes are taken from the stream, not re-read from the file, so that what is checked is what
 * was written; the entry is put in place only when size, FNV and SHA-256 all match. */
static int receive_mode(const char *dir, uint64_t size, const char *want_fnv,
                        const char *want_sha)
{
    size_t plen = strlen(dir) + 64;
    char *tmp = malloc(plen), *final = malloc(plen);
    const size_t bufsize = (size_t)1 << 20;
    unsigned char *buf = malloc(bufsize);
    if (!tmp || !final || !buf)
        die("out of memory", NULL);
    snprintf(tmp, plen, "%s/.%s.tmp", dir, want_fnv);
    snprintf(final, plen, "%s/%s", dir, want_fnv);
    int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0)
        die("cannot create", tmp);

    uint64_t h = FNV_BASIS, got = 0;
    struct sha256 sha;
    sha256_init(&sha);
    while (got < size) {
        size_t want = size - got < bufsize ? (size_t)(size - got) : bufsize;
        ssize_t r = read_some(STDIN_FILENO, buf, want);
        if (r < 0)
            fail_receive(tmp, "cannot read stdin for", tmp);
        if (r == 0)
            break;
        h = fnv1a_sha256(h, &sha, buf, (size_t)r);
        for (ssize_t w = 0; w < r;) {
            ssize_t k = write(out, buf + w, (size_t)(r - w));
            if (k < 0 && errno != EINTR)
                fail_receive(tmp, "cannot write", tmp);
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
            fail_receive(tmp, "cannot read stdin for", tmp);
        more = r > 0;
    }
    unsigned char d[32];
    char fnv_hex[17], sha_hex[65];
    sha256_final(&sha, d);
    sha256_hex(d, sha_hex);
    snprintf(fnv_hex, sizeof fnv_hex, "%016" PRIx64, h);
    int bad_fnv = strcmp(fnv_hex, want_fnv) != 0, bad_sha = strcmp(sha_hex, want_sha) != 0;
    if (got != size || more || bad_fnv || bad_sha) {
        close(out);
        unlink(tmp);
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
    struct stat st;
    if (fsync(out) < 0 || fstat(out, &st) < 0 || close(out) < 0)
        fail_receive(tmp, "cannot flush", tmp);
    if ((uint64_t)st.st_size != size) {
        unlink(tmp);
        fprintf(stderr, "%s: %s holds %jd bytes, expected %" PRIu64 "\n", prog, tmp,
                (intmax_t)st.st_size, size);
        return 1;
    }
    if (rename(tmp, final) < 0)
        fail_receive(tmp, "cannot rename into", final);
    int dfd = open(dir, O_RDONLY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    printf("%s %" PRIu64 " written\n", want_fnv, size);
    free(buf);
    free(tmp);
    free(final);
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
    struct stat st;
    const char *why = NULL;
    if (stat(argv[2], &st) < 0 || !S_ISDIR(st.st_mode))
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
    return receive_mode(argv[2], size, argv[4], argv[5]);
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
