/* An episode's root: the overlay, the container's mounts, /dev, /proc, /sys; the pivot. */
#include "helper.h"

struct mnt mounts[MAX_MOUNTS];
int n_mounts;
char image_user[256], base_cwd[PATH_MAX], hostname[256];
char shm_opts[128] = "size=65536k";
char **base_env;

void die(const char *what) {
    fprintf(stderr, "tmax-eph: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* ---- small helpers ------------------------------------------------------------------ */

int write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

void say(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void say(int fd, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0) write_all(fd, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

/* mountinfo escapes space, tab, newline and backslash as \ooo */
static void unescape(char *s) {
    char *o = s;
    for (char *p = s; *p; p++) {
        if (p[0] == '\\' && p[1] >= '0' && p[1] <= '7' && p[2] && p[3]) {
            *o++ = (char)((p[1] - '0') * 64 + (p[2] - '0') * 8 + (p[3] - '0'));
            p += 3;
        } else {
            *o++ = *p;
        }
    }
    *o = 0;
}

static int has_opt(const char *opts, const char *opt) {
    size_t n = strlen(opt);
    for (const char *p = opts; p && *p;) {
        if (strncmp(p, opt, n) == 0 && (p[n] == ',' || p[n] == 0)) return 1;
        p = strchr(p, ',');
        if (p) p++;
    }
    return 0;
}

/* The container's mounts, as serve sees them at its start. */
void read_mounts(void) {
    FILE *f = fopen("/proc/self/mountinfo", "r");
    if (!f) die("open mountinfo");
    char line[8192];
    while (fgets(line, sizeof line, f) && n_mounts < MAX_MOUNTS) {
        char root[PATH_MAX], point[PATH_MAX], opts[1024], fstype[64], super[1024];
        int id, parent;
        unsigned ma, mi;
        if (sscanf(line, "%d %d %u:%u %4095s %4095s %1023s", &id, &parent, &ma, &mi, root, point, opts) != 7)
            continue;
        char *dash = strstr(line, " - ");
        if (!dash || sscanf(dash + 3, "%63s %*s %1023s", fstype, super) < 1) continue;
        unescape(point);
        if (strcmp(point, "/") == 0) continue;
        struct mnt *m = &mounts[n_mounts++];
        snprintf(m->point, sizeof m->point, "%s", point);
        snprintf(m->fstype, sizeof m->fstype, "%s", fstype);
        m->ro = has_opt(opts, "ro");
        struct stat st;
        m->is_file = stat(point, &st) == 0 && !S_ISDIR(st.st_mode);
        if (strcmp(point, "/dev/shm") == 0) {
            char *sz = strstr(super, "size=");
            if (sz) snprintf(shm_opts, sizeof shm_opts, "%.*s", (int)strcspn(sz, ","), sz);
        }
    }
    fclose(f);
}

static int under(const char *path, const char *dir) {
    size_t n = strlen(dir);
    return strncmp(path, dir, n) == 0 && (path[n] == '/' || path[n] == 0);
}

static int copy_file(const char *src, const char *dst) {
    int in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0) return -1;
    struct stat st;
    fstat(in, &st);
    int out = open(dst, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, st.st_mode & 07777);
    if (out < 0) {
        close(in);
        return -1;
    }
    char buf[65536];
    ssize_t r;
    int rc = 0;
    while ((r = read(in, buf, sizeof buf)) > 0)
        if (write_all(out, buf, (size_t)r) < 0) { rc = -1; break; }
    if (r < 0) rc = -1;
    fchmod(out, st.st_mode & 07777);
    close(in);
    close(out);
    return rc;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    remove(path);
    return 0;
}

void remove_tree(const char *path) { nftw(path, rm_entry, 32, FTW_DEPTH | FTW_PHYS | FTW_MOUNT); }

/* ---- the episode's root --------------------------------------------------------------- */

/* The frozen layers a forked episode stands on, top first (layers.c); none for a fresh one. */
static const char **root_chain;
static int root_nchain;

static int overlay(const char *lower, const char *base, int idx, const char *target) {
    char up[PATH_MAX + 32], wk[PATH_MAX + 32], lowers[(MAX_CHAIN + 1) * PATH_MAX], opts[sizeof lowers + 2 * PATH_MAX + 64];
    snprintf(up, sizeof up, "%s/u/%d", base, idx);
    snprintf(wk, sizeof wk, "%s/w/%d", base, idx);
    if (mkdir(up, 0755) < 0 || mkdir(wk, 0700) < 0) return -1;
    size_t n = 0;
    lowers[0] = 0;
    for (int k = 0; k < root_nchain; k++) {
        char layer[PATH_MAX];
        layer_path(layer, sizeof layer, root_chain[k], idx);
        n += (size_t)snprintf(lowers + n, sizeof lowers - n, "%s:", layer);
        if (n >= sizeof lowers) { errno = ENAMETOOLONG; return -1; }
    }
    snprintf(lowers + n, sizeof lowers - n, "%s", lower);
    snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=%s,workdir=%s", lowers, up, wk);
    return mount("overlay", target, "overlay", 0, opts);
}

static int bind_ro(const char *src, const char *dst, int ro, unsigned long extra) {
    if (mount(src, dst, NULL, MS_BIND | MS_REC, NULL) < 0) return -1;
    if (!ro) return 0;
    return mount(NULL, dst, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | extra, NULL);
}

/* /proc of the new pid namespace, masked as podman masked the container's. */
static int setup_proc(const char *root) {
    char p[PATH_MAX * 2];
    snprintf(p, sizeof p, "%s/proc", root);
    if (mount("proc", p, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) return -1;
    for (int i = 0; i < n_mounts; i++) {
        struct mnt *m = &mounts[i];
        if (!under(m->point, "/proc") || strcmp(m->point, "/proc") == 0) continue;
        snprintf(p, sizeof p, "%s%s", root, m->point);
        int rc;
        if (strcmp(m->fstype, "proc") == 0)
            rc = bind_ro(p, p, m->ro, MS_NOSUID | MS_NODEV | MS_NOEXEC);
        else if (m->is_file)
            rc = bind_ro("/dev/null", p, 0, 0);
        else
            rc = mount("tmpfs", p, "tmpfs", m->ro ? MS_RDONLY : 0, "size=0");
        if (rc < 0 && errno != ENOENT) return -1;
    }
    return 0;
}

/* A new /dev: the container's device nodes bound in, fresh pts, shm and mqueue. */
static int setup_dev(const char *root) {
    char dev[PATH_MAX], p[PATH_MAX * 2], src[PATH_MAX * 2];
    snprintf(dev, sizeof dev, "%s/dev", root);
    if (mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=65536k") < 0) return -1;
    DIR *d = opendir("/dev");
    if (!d) return -1;
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *n = e->d_name;
        if (n[0] == '.' && (n[1] == 0 || (n[1] == '.' && n[2] == 0))) continue;
        snprintf(p, sizeof p, "%s/%s", dev, n);
        snprintf(src, sizeof src, "/dev/%s", n);
        struct stat st;
        if (lstat(src, &st) < 0) continue;
        if (strcmp(n, "ptmx") == 0) {
            symlink("pts/ptmx", p);
        } else if (S_ISLNK(st.st_mode)) {
            char target[PATH_MAX];
            ssize_t k = readlink(src, target, sizeof target - 1);
            if (k > 0) { target[k] = 0; symlink(target, p); }
        } else if (S_ISDIR(st.st_mode)) {
            mkdir(p, st.st_mode & 07777);
        } else if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) {
            int fd = open(p, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
            if (fd >= 0) close(fd);
            if (mount(src, p, NULL, MS_BIND, NULL) < 0) { closedir(d); return -1; }
        }
    }
    closedir(d);
    snprintf(p, sizeof p, "%s/pts", dev);
    mkdir(p, 0755);
    if (mount("devpts", p, "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5") < 0)
        return -1;
    snprintf(p, sizeof p, "%s/shm", dev);
    mkdir(p, 01777);
    if (mount("shm", p, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, shm_opts) < 0) return -1;
    snprintf(p, sizeof p, "%s/mqueue", dev);
    mkdir(p, 0755);
    mount("mqueue", p, "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    return 0;
}

/* The container's other mounts, in the new root: writable directories as overlays of their
 * own, podman's writable files (hosts, hostname, resolv.conf, .containerenv) copied into
 * the upper layer, read-only ones bound read-only. */
static int setup_other_mounts(const char *root, const char *base) {
    char p[PATH_MAX * 2];
    for (int i = 0; i < n_mounts; i++) {
        struct mnt *m = &mounts[i];
        if (under(m->point, "/proc") || under(m->point, "/dev") || under(m->point, "/sys") ||
            under(m->point, IN_DIR) || strcmp(m->point, IN_BIN) == 0)
            continue;
        snprintf(p, sizeof p, "%s%s", root, m->point);
        int rc;
        if (m->ro)
            rc = bind_ro(m->point, p, 1, 0);
        else if (m->is_file)
            rc = copy_file(m->point, p);
        else
            rc = overlay(m->point, base, i + 1, p);
        if (rc < 0) {
            fprintf(stderr, "tmax-eph: mount %s: %s\n", m->point, strerror(errno));
            return -1;
        }
    }
    return 0;
}

static int loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) return -1;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
    int rc = ioctl(s, SIOCGIFFLAGS, &ifr);
    if (rc == 0) {
        ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
        rc = ioctl(s, SIOCSIFFLAGS, &ifr);
    }
    close(s);
    return rc;
}

int make_root(const char *id, int own_net, const char **chain, int nchain, const char **what) {
    char base[PATH_MAX], root[PATH_MAX + 8], p[PATH_MAX + 16];
    root_chain = chain;
    root_nchain = nchain;
    snprintf(base, sizeof base, IN_DIR "/ep-%s", id);
    snprintf(root, sizeof root, "%s/root", base);
    *what = "mount namespace";
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) return -1;
    *what = "episode directories";
    snprintf(p, sizeof p, "%s/u", base);
    if (mkdir(base, 0700) < 0 || mkdir(p, 0755) < 0) return -1;
    snprintf(p, sizeof p, "%s/w", base);
    if (mkdir(p, 0700) < 0 || mkdir(root, 0755) < 0) return -1;
    *what = "overlay of /";
    if (overlay("/", base, 0, root) < 0) return -1;
    *what = "the container's mounts";
    if (setup_other_mounts(root, base) < 0) return -1;
    *what = "/dev";
    if (setup_dev(root) < 0) return -1;
    *what = "/proc";
    if (setup_proc(root) < 0) return -1;
    *what = "/sys";
    snprintf(p, sizeof p, "%s/sys", root);
    if (bind_ro("/sys", p, 1, MS_NOSUID | MS_NODEV | MS_NOEXEC) < 0) return -1;
    *what = "hostname";
    if (sethostname(hostname, strlen(hostname)) < 0) return -1;
    *what = "loopback";
    if (own_net && loopback_up() < 0) return -1;
    return 0;
}

int enter_root(const char *id) {
    char root[PATH_MAX];
    snprintf(root, sizeof root, IN_DIR "/ep-%s/root", id);
    if (chdir(root) < 0) return -1;
    if (syscall(SYS_pivot_root, ".", ".") < 0) return -1;
    if (umount2(".", MNT_DETACH) < 0) return -1;
    if (chdir("/") < 0) return -1;
    if (chdir(base_cwd) < 0 && chdir("/") < 0) return -1;
    return 0;
}
