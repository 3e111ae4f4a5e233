/*
 * A power-loss recorder, preloaded into the writer of test_power_loss.py
 * (LD_PRELOAD). A SIGKILL keeps the page cache: what a process wrote survives it,
 * synced or not. A power loss keeps only what reached the disk, and POSIX promises
 * only this: a file's data as of its last fsync or fdatasync, and a directory's
 * entries as of the directory's last fsync.
 *
 * This library records exactly that while the writer runs, for the watched directory
 * (IMQ_PL_WATCH) and everything below it. Each successful fsync or fdatasync of a
 * regular file copies the file's whole content to IMQ_PL_SHADOW/<id>; each of a
 * directory writes its entries to IMQ_PL_SHADOW/<id>.dir, a line "<id> f|d <name>"
 * each (regular files and directories; nothing else is kept). <id> is the inode and
 * birth time; IMQ_PL_SHADOW/root names the watched directory's. Every record is
 * written to a temporary file and renamed, before the sync call returns: a SIGKILL at
 * any point leaves each record whole, and no caller ever saw a sync return before its
 * record existed. The test then builds the tree a power loss would have left: from
 * the root's last listing down, each name holding its file's last synced content
 * (empty if it was never synced), each directory its own last listing (empty if it
 * was never synced).
 *
 * The birth time tells a file from a later one that reuses its inode number.
 * Nothing else is intercepted: writes go to the real files as always.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static char watch[PATH_MAX];
static const char *shadow;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long counter;

__attribute__((constructor)) static void
setup(void)
{
    real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    const char *w = getenv("IMQ_PL_WATCH");
    shadow = getenv("IMQ_PL_SHADOW");
    if (w == NULL || shadow == NULL || realpath(w, watch) == NULL)
        watch[0] = '\0';
}

static void publish(const char *tmp, const char *name);
static int identity(int dirfd, const char *name, int flags, char *out, size_t n, int *is_dir);

/* IMQ_PL_SHADOW/root: the watched directory's id, where the rebuilt tree starts. */
static void
record_root(void)
{
    static int done;
    char id[96], tmp[PATH_MAX];
    int is_dir = 0;
    if (done || identity(AT_FDCWD, watch, 0, id, sizeof id, &is_dir) != 0 || !is_dir)
        return;
    snprintf(tmp, sizeof tmp, "%s/tmp.%d.%lu", shadow, (int)getpid(), counter++);
    FILE *out = fopen(tmp, "w");
    if (out == NULL || fprintf(out, "%s\n", id) < 0 || fclose(out) != 0)
        return;
    publish(tmp, "root");
    done = 1;
}

/* The file's identity: inode and birth time (statx), or -1. */
static int
identity(int dirfd, const char *name, int flags, char *out, size_t n, int *is_dir)
{
    struct statx sx;
    if (statx(dirfd, name, flags | AT_SYMLINK_NOFOLLOW, STATX_INO | STATX_BTIME | STATX_TYPE,
              &sx) != 0)
        return -1;
    *is_dir = S_ISDIR(sx.stx_mode);
    if (!S_ISDIR(sx.stx_mode) && !S_ISREG(sx.stx_mode))
        return -1;
    snprintf(out, n, "%llu-%lld.%09u", (unsigned long long)sx.stx_ino,
             (long long)sx.stx_btime.tv_sec, sx.stx_btime.tv_nsec);
    return 0;
}

static void
die(const char *what)
{
    /* A record that cannot be written would make the test check less than it says. */
    fprintf(stderr, "powerloss_shim: %s: %s\n", what, strerror(errno));
    abort();
}

static void
publish(const char *tmp, const char *name)
{
    char dst[PATH_MAX];
    snprintf(dst, sizeof dst, "%s/%s", shadow, name);
    if (rename(tmp, dst) != 0)
        die("rename");
}

static void
record_file(int fd, const char *id)
{
    char src[64], tmp[PATH_MAX], buf[1 << 16];
    snprintf(src, sizeof src, "/proc/self/fd/%d", fd);
    int in = open(src, O_RDONLY | O_CLOEXEC); /* the same file, even if fd is write-only */
    if (in < 0)
        die("open for copy");
    snprintf(tmp, sizeof tmp, "%s/tmp.%d.%lu", shadow, (int)getpid(), counter++);
    int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0)
        die("create copy");
    for (;;) {
        ssize_t got = read(in, buf, sizeof buf);
        if (got < 0)
            die("read for copy");
        if (got == 0)
            break;
        for (ssize_t done = 0; done < got;) {
            ssize_t put = write(out, buf + done, (size_t)(got - done));
            if (put < 0)
                die("write copy");
            done += put;
        }
    }
    close(in);
    close(out);
    publish(tmp, id);
}

static void
record_listing(const char *path, const char *id)
{
    char tmp[PATH_MAX], entry[96], name[128];
    snprintf(tmp, sizeof tmp, "%s/tmp.%d.%lu", shadow, (int)getpid(), counter++);
    FILE *out = fopen(tmp, "w");
    DIR *d = opendir(path);
    if (out == NULL || d == NULL)
        die("listing");
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int is_dir = 0;
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        if (identity(dirfd(d), e->d_name, 0, entry, sizeof entry, &is_dir) == 0)
            fprintf(out, "%s %c %s\n", entry, is_dir ? 'd' : 'f', e->d_name);
    }
    closedir(d);
    if (fclose(out) != 0)
        die("write listing");
    snprintf(name, sizeof name, "%s.dir", id);
    publish(tmp, name);
}

static void
record(int fd)
{
    if (watch[0] == '\0')
        return;
    char link[64], path[PATH_MAX], id[96];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0)
        return;
    path[n] = '\0';
    size_t w = strlen(watch);
    if (strncmp(path, watch, w) != 0 || (path[w] != '\0' && path[w] != '/'))
        return;
    int is_dir = 0;
    if (identity(fd, "", AT_EMPTY_PATH, id, sizeof id, &is_dir) != 0)
        return;
    int saved = errno;
    pthread_mutex_lock(&lock);
    record_root();
    if (is_dir)
        record_listing(path, id);
    else
        record_file(fd, id);
    pthread_mutex_unlock(&lock);
    errno = saved;
}

int
fsync(int fd)
{
    int r = real_fsync(fd);
    if (r == 0)
        record(fd);
    return r;
}

int
fdatasync(int fd)
{
    int r = real_fdatasync(fd);
    if (r == 0)
        record(fd);
    return r;
}
