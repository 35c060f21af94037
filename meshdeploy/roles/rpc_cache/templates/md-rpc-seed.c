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
 *   md-rpc-seed [--verify] GGUF CACHE_DIR < list     one "<offset> <size>" per line
 *   md-rpc-seed --hash FILE OFFSET SIZE               print the hash of one byte range
 *
 * Output per tensor: "<16hex> <size> <kept|written>". Exit status 0 only when every tensor
 * has a complete entry.
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
/* Map the source in windows: a 32-bit host cannot map a multi-GB GGUF at once. */
#define WINDOW ((size_t)256 << 20)

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

/* Hash [offset, offset+size) of fd; when out >= 0 also copy the bytes there. */
static int hash_range(int fd, uint64_t offset, uint64_t size, int out, uint64_t *hash)
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
        h = fnv1a(h, m + lead, n);
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
    int rc = hash_range(fd, 0, size, -1, hash);
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
    if (hash_range(fd, off, size, -1, &h) < 0)
        die("cannot read", path);
    printf("%016" PRIx64 "\n", h);
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
    if (hash_range(src, off, size, out, hash) < 0) {
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

    char line[256];
    unsigned long lineno = 0;
    while (fgets(line, sizeof line, stdin)) {
        lineno++;
        char a[64], b[64], extra[2];
        if (line[0] == '\n' || line[0] == '\0')
            continue;
        int n = sscanf(line, "%63s %63s %1s", a, b, extra);
        uint64_t off, size;
        if (n != 2 || parse_u64(a, &off) || parse_u64(b, &size)) {
            fprintf(stderr, "%s: stdin line %lu: expected \"<offset> <size>\", got: %s", prog,
                    lineno, line);
            return 1;
        }
        if (off > (uint64_t)gst.st_size || size > (uint64_t)gst.st_size - off) {
            fprintf(stderr, "%s: stdin line %lu: %" PRIu64 "+%" PRIu64 " is past the end of "
                    "%s (%jd bytes): wrong tensor list for this file?\n", prog, lineno, off,
                    size, gguf, (intmax_t)gst.st_size);
            return 1;
        }
        uint64_t h;
        /* The name is only known after hashing; hash the source first, then decide. */
        if (hash_range(src, off, size, -1, &h) < 0)
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
    if (ferror(stdin))
        die("cannot read the tensor list from stdin", NULL);
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

static void usage(void)
{
    fprintf(stderr, "usage: %s [--verify] GGUF CACHE_DIR < list   (\"<offset> <size>\" lines)\n"
                    "       %s --hash FILE OFFSET SIZE\n", prog, prog);
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "--hash") == 0)
        return hash_mode(argv[2], argv[3], argv[4]);
    if (argc == 4 && strcmp(argv[1], "--verify") == 0)
        return seed_mode(argv[2], argv[3], 1);
    if (argc == 3 && argv[1][0] != '-')
        return seed_mode(argv[1], argv[2], 0);
    usage();
    return 2;
}
