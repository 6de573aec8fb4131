/*
 * tmax-eph: a fresh copy of a container for each episode, inside one long-lived container.
 *
 * `tmax-eph serve IMAGE_USER CAPACITY IDLE_SECONDS` is the container's main process (under
 * podman's init), its state directory STATE_DIR (a host directory) mounted at /run/tmax-eph.
 * For each connection to STATE_DIR/ctl.sock that asks "EPISODE <id> own|shared" (while
 * fewer than CAPACITY episodes are live; "ERR busy" otherwise) it
 * clones an episode init: pid 1 of new mount, pid, ipc and uts namespaces (and a network
 * namespace holding only `lo` for "own"). The init mounts an overlay of the container's
 * root with a fresh upper layer (STATE_DIR/ep-<id>/u, on the host's disk) as its root; the
 * container's other writable mounts get an overlay each, podman's generated files
 * (/etc/hosts, ...) are copied in, /proc is mounted anew with the container's masks, /dev is
 * a new tmpfs with the container's device nodes and fresh pts, shm and mqueue, /sys is the
 * container's, read-only. It then pivots into that root, installs a seccomp filter against
 * namespace and mount syscalls, drops CAP_SYS_ADMIN from every capability set and the
 * bounding set, and answers "READY" with an fd of its root on the connection, which the
 * caller holds for the episode's life (the lease).
 *
 * Each connection to STATE_DIR/ep-<id>.sock carries one spawn request: three fds (stdin,
 * stdout, stderr: a pty slave three times, or pipes) and a payload of NUL-terminated
 * "key=value" strings (mode=pty|pipe, user=NAME|UID, cwd=PATH, env=K=V..., arg=...). The
 * init forks the process as a session leader in the episode, replies "PID <n>", and
 * "EXIT <code> <signal>" when it ends; a caller that hangs up first gets its process group
 * killed. When the lease ends (EOF), every process of the episode is killed with the pid
 * namespace; serve then deletes the episode's upper layer and socket. With no episode for
 * IDLE_SECONDS, or after "QUIT" once no episode is live (it takes no new one meanwhile),
 * serve empties STATE_DIR and exits, and the container ends.
 *
 * Built static (no library of the task image is used) by tmax/sandbox/overlay_build.py.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <limits.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>

#define MAX_MOUNTS 256
#define MAX_CHILDREN 256
#define MAX_REQUEST (1 << 22)
#define IN_DIR "/run/tmax-eph"   /* where the state dir is mounted in the container */
#define IN_BIN "/run/tmax-eph.bin"

extern char **environ;

struct mnt {
    char point[PATH_MAX];
    char fstype[64];
    int ro, is_file;
};

static struct mnt mounts[MAX_MOUNTS];
static int n_mounts;
static char image_user[256], base_cwd[PATH_MAX], hostname[256];
static char shm_opts[128] = "size=65536k";
static char **base_env;

static void die(const char *what) {
    fprintf(stderr, "tmax-eph: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* ---- small helpers ------------------------------------------------------------------ */

static int write_all(int fd, const void *buf, size_t n) {
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

static void say(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(int fd, const char *fmt, ...) {
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
static void read_mounts(void) {
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

static void remove_tree(const char *path) { nftw(path, rm_entry, 32, FTW_DEPTH | FTW_PHYS | FTW_MOUNT); }

/* ---- the episode's root --------------------------------------------------------------- */

static int overlay(const char *lower, const char *base, int idx, const char *target) {
    char up[PATH_MAX + 32], wk[PATH_MAX + 32], opts[3 * PATH_MAX + 64];
    snprintf(up, sizeof up, "%s/u/%d", base, idx);
    snprintf(wk, sizeof wk, "%s/w/%d", base, idx);
    if (mkdir(up, 0755) < 0 || mkdir(wk, 0700) < 0) return -1;
    snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=%s,workdir=%s", lower, up, wk);
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

static int make_root(const char *id, int own_net, const char **what) {
    char base[PATH_MAX], root[PATH_MAX + 8], p[PATH_MAX + 16];
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

static int enter_root(const char *id) {
    char root[PATH_MAX];
    snprintf(root, sizeof root, IN_DIR "/ep-%s/root", id);
    if (chdir(root) < 0) return -1;
    if (syscall(SYS_pivot_root, ".", ".") < 0) return -1;
    if (umount2(".", MNT_DETACH) < 0) return -1;
    if (chdir("/") < 0) return -1;
    if (chdir(base_cwd) < 0 && chdir("/") < 0) return -1;
    return 0;
}

/* ---- what episode processes may not do ----------------------------------------------- */

#define NS_FLAGS (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | \
                  CLONE_NEWNET | CLONE_NEWCGROUP)
#define MAX_FILTER 64

struct abi {
    uint32_t arch;
    int x32;  /* x86-64: calls with bit 30 set are x32 ones, same numbers */
    int clone, clone3;
    int denied[16];
    int n_denied;
};

/* One filter per ABI: a call of another ABI passes this one (the next filter judges it). */
static int install_abi_filter(const struct abi *a) {
    struct sock_filter f[MAX_FILTER];
    int n = 0;
    f[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch));
    f[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, a->arch, 1, 0);
    f[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    f[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
    if (a->x32) f[n++] = (struct sock_filter)BPF_STMT(BPF_ALU | BPF_AND | BPF_K, ~0x40000000u);
    for (int i = 0; i < a->n_denied; i++) {
        f[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)a->denied[i], 0, 1);
        f[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
    }
    f[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)a->clone3, 0, 1);
    f[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS);  /* libc falls back to clone */
    f[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)a->clone, 0, 3);
    f[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0]));
    f[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, NS_FLAGS, 0, 1);
    f[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
    f[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    struct sock_fprog prog = {(unsigned short)n, f};
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

/* The container runs with CAP_SYS_ADMIN, so podman's seccomp profile lets namespace and mount
 * syscalls through for it. Episode processes never hold the capability; these filters refuse
 * what the profile would otherwise leave open to them (new user namespaces above all), as it
 * does for a container without the capability, for every ABI a program here can use. */
static int install_filter(void) {
    const struct abi native = {
#if defined(__x86_64__)
        AUDIT_ARCH_X86_64, 1,
#elif defined(__aarch64__)
        AUDIT_ARCH_AARCH64, 0,
#endif
        SYS_clone, SYS_clone3,
        {SYS_mount, SYS_umount2, SYS_pivot_root, SYS_unshare, SYS_setns, SYS_open_tree, SYS_move_mount,
         SYS_fsopen, SYS_fsconfig, SYS_fsmount, SYS_fspick, SYS_mount_setattr}, 12};
    if (install_abi_filter(&native) < 0) return -1;
#if defined(__x86_64__)
    /* 32-bit x86 programs run here too: the same calls by their i386 numbers (asm/unistd_32.h). */
    const struct abi i386 = {AUDIT_ARCH_I386, 0, 120, 435,
                             {21, 22, 52, 217, 310, 346, 428, 429, 430, 431, 432, 433, 442}, 13};
    if (install_abi_filter(&i386) < 0) return -1;
#endif
    return 0;
}

/* The capabilities the container holds for the helper alone (mounts, the loopback of an
 * episode's own network): gone from every set of the episode's processes, bounding included. */
static const int helper_caps[] = {CAP_SYS_ADMIN, CAP_NET_ADMIN};

static int drop_helper_caps(void) {
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    for (size_t k = 0; k < sizeof helper_caps / sizeof helper_caps[0]; k++)
        if (prctl(PR_CAPBSET_DROP, helper_caps[k], 0, 0, 0) < 0) return -1;
    if (syscall(SYS_capget, &h, d) < 0) return -1;
    for (size_t k = 0; k < sizeof helper_caps / sizeof helper_caps[0]; k++) {
        uint32_t bit = 1u << (helper_caps[k] % 32);
        int i = helper_caps[k] / 32;
        d[i].effective &= ~bit;
        d[i].permitted &= ~bit;
        d[i].inheritable &= ~bit;
    }
    return (int)syscall(SYS_capset, &h, d);
}

/* ---- users, as podman's --user: NAME or UID, optionally :GROUP ------------------------ */

struct who {
    uid_t uid;
    gid_t gid;
    char home[PATH_MAX];
    gid_t groups[64];
    int ngroups;
};

static int numeric(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return 0;
    return 1;
}

/* The `n` colon-separated fields of a passwd or group line (the last without its newline);
 * -1 when it has fewer. */
static int split_fields(char *line, char **fields, int n) {
    char *p = line;
    for (int i = 0; i < n && p; i++) {
        fields[i] = p;
        p = strchr(p, ':');
        if (p) *p++ = 0;
    }
    if (!fields[n - 1]) return -1;
    fields[n - 1][strcspn(fields[n - 1], "\n")] = 0;
    return 0;
}

/* The user's passwd entry in the episode's /etc/passwd; 0 when found. */
static int passwd_entry(const char *user, struct who *w, char *name, size_t name_len) {
    FILE *f = fopen("/etc/passwd", "re");
    if (!f) return -1;
    char line[4096];
    int found = -1;
    while (found < 0 && fgets(line, sizeof line, f)) {
        char *fields[7] = {0};
        if (split_fields(line, fields, 7) < 0) continue;
        if (numeric(user) ? (uid_t)strtoul(fields[2], NULL, 10) != (uid_t)strtoul(user, NULL, 10)
                          : strcmp(fields[0], user) != 0)
            continue;
        w->uid = (uid_t)strtoul(fields[2], NULL, 10);
        w->gid = (gid_t)strtoul(fields[3], NULL, 10);
        snprintf(w->home, sizeof w->home, "%s", fields[5]);
        snprintf(name, name_len, "%s", fields[0]);
        found = 0;
    }
    fclose(f);
    return found;
}

/* Supplementary groups: every /etc/group entry that lists `name`, or that is `group`. */
static void group_entries(const char *name, const char *group, struct who *w) {
    FILE *f = fopen("/etc/group", "re");
    if (!f) return;
    char line[8192];
    while (fgets(line, sizeof line, f) && w->ngroups < 64) {
        char *fields[4] = {0};
        if (split_fields(line, fields, 4) < 0) continue;
        gid_t gid = (gid_t)strtoul(fields[2], NULL, 10);
        if (group && strcmp(fields[0], group) == 0) w->gid = gid;
        for (char *m = strtok(fields[3], ","); m && *name; m = strtok(NULL, ","))
            if (strcmp(m, name) == 0) w->groups[w->ngroups++] = gid;
    }
    fclose(f);
}

static int resolve_user(const char *spec, struct who *w) {
    char user[256], name[256] = "", *group = NULL;
    snprintf(user, sizeof user, "%s", *spec ? spec : (*image_user ? image_user : "0"));
    char *colon = strchr(user, ':');
    if (colon) { *colon = 0; group = colon + 1; }
    memset(w, 0, sizeof *w);
    if (passwd_entry(user, w, name, sizeof name) < 0) {
        if (!numeric(user)) return -1;
        w->uid = (uid_t)strtoul(user, NULL, 10);
        w->gid = 0;
        snprintf(w->home, sizeof w->home, "/");
    }
    if (group && numeric(group)) {
        w->gid = (gid_t)strtoul(group, NULL, 10);
        group = NULL;
    }
    group_entries(name, group, w);
    w->groups[w->ngroups++] = w->gid;
    return 0;
}

/* ---- spawning a process in the episode ------------------------------------------------- */

struct req {
    char *buf;
    int fds[3], nfds, pty, rows, cols;
    const char *user, *cwd;
    char *env[512], *argv[4096];
    int nenv, nargv;
};

static int recv_request(int conn, struct req *r) {
    uint32_t len = 0;
    char cbuf[CMSG_SPACE(3 * sizeof(int))];
    struct iovec iov = {&len, sizeof len};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    ssize_t n = recvmsg(conn, &mh, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    if (n != (ssize_t)sizeof len || len == 0 || len > MAX_REQUEST) return -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            r->nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            memcpy(r->fds, CMSG_DATA(c), (size_t)(r->nfds > 3 ? 3 : r->nfds) * sizeof(int));
        }
    r->buf = malloc(len + 1);
    if (!r->buf || recv(conn, r->buf, len, MSG_WAITALL) != (ssize_t)len) return -1;
    r->buf[len] = 0;
    r->user = "";
    r->cwd = NULL;
    for (char *p = r->buf; p < r->buf + len; p += strlen(p) + 1) {
        if (strncmp(p, "arg=", 4) == 0 && r->nargv < 4095) r->argv[r->nargv++] = p + 4;
        else if (strncmp(p, "env=", 4) == 0 && r->nenv < 511) r->env[r->nenv++] = p + 4;
        else if (strncmp(p, "user=", 5) == 0) r->user = p + 5;
        else if (strncmp(p, "cwd=", 4) == 0) r->cwd = p + 4;
        else if (strcmp(p, "mode=pty") == 0) r->pty = 1;
        else if (strncmp(p, "rows=", 5) == 0) r->rows = atoi(p + 5);
        else if (strncmp(p, "cols=", 5) == 0) r->cols = atoi(p + 5);
    }
    r->argv[r->nargv] = NULL;
    return (r->pty ? r->nfds == 0 : r->nfds == 3) && r->nargv > 0 ? 0 : -1;
}

/* The process's environment: the container's, HOME of its user, then the request's. */
static char **build_env(struct req *r, const struct who *w) {
    static char home[PATH_MAX + 8];
    int n = 0, cap = 0;
    for (char **e = base_env; *e; e++) cap++;
    char **env = calloc((size_t)(cap + r->nenv + 2), sizeof *env);
    for (char **e = base_env; *e; e++)
        if (strncmp(*e, "HOME=", 5) != 0) env[n++] = *e;
    snprintf(home, sizeof home, "HOME=%s", w->home);
    env[n++] = home;
    for (int i = 0; i < r->nenv; i++) {
        size_t k = strcspn(r->env[i], "=");
        int j = 0;
        while (j < n && !(strncmp(env[j], r->env[i], k) == 0 && env[j][k] == '=')) j++;
        env[j] = r->env[i];
        if (j == n) n++;
    }
    env[n] = NULL;
    return env;
}

static void child_exec(struct req *r, const struct who *w, char **env) {
    sigset_t none;
    sigemptyset(&none);
    for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, NULL);
    setsid();
    for (int i = 0; i < 3; i++) dup2(r->fds[i], i);
    if (r->pty) ioctl(0, TIOCSCTTY, 0);
    syscall(SYS_close_range, 3, ~0U, 0);
    if (setgroups((size_t)w->ngroups, w->groups) < 0 || setgid(w->gid) < 0 || setuid(w->uid) < 0) {
        fprintf(stderr, "tmax-eph: cannot switch to uid %u: %s\n", w->uid, strerror(errno));
        _exit(126);
    }
    if (r->cwd && chdir(r->cwd) < 0) {
        fprintf(stderr, "tmax-eph: cannot cd to %s: %s\n", r->cwd, strerror(errno));
        _exit(126);
    }
    environ = env;
    execvp(r->argv[0], r->argv);
    fprintf(stderr, "tmax-eph: %s: %s\n", r->argv[0], strerror(errno));
    _exit(errno == ENOENT ? 127 : 126);
}

/* A pty of the episode's own devpts (so that ttyname() works inside): its master goes back
 * to the caller, the slave becomes the process's terminal. */
static int open_episode_pty(struct req *r, int *master) {
    *master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (*master < 0 || grantpt(*master) < 0 || unlockpt(*master) < 0) return -1;
    char *name = ptsname(*master);
    int slave = name ? open(name, O_RDWR | O_NOCTTY | O_CLOEXEC) : -1;
    if (slave < 0) return -1;
    struct termios t;
    if (tcgetattr(slave, &t) == 0) {
        t.c_lflag &= ~(tcflag_t)ECHO;
        tcsetattr(slave, TCSANOW, &t);
    }
    struct winsize ws = {(unsigned short)(r->rows > 0 ? r->rows : 50), (unsigned short)(r->cols > 0 ? r->cols : 200),
                         0, 0};
    ioctl(slave, TIOCSWINSZ, &ws);
    for (int i = 0; i < 3; i++) r->fds[i] = slave;
    r->nfds = 1;  /* one fd to close in the parent */
    return 0;
}

static pid_t spawn(struct req *r, char *err, size_t errlen) {
    struct who w;
    if (resolve_user(r->user, &w) < 0) {
        snprintf(err, errlen, "no such user: %s", *r->user ? r->user : image_user);
        return -1;
    }
    char **env = build_env(r, &w);
    pid_t pid = fork();
    if (pid == 0) child_exec(r, &w, env);
    if (pid < 0) snprintf(err, errlen, "fork: %s", strerror(errno));
    free(env);
    return pid;
}

/* ---- the episode's pid 1 --------------------------------------------------------------- */

struct child {
    pid_t pid;
    int conn;
};

static struct child kids[MAX_CHILDREN];

static int listen_at(const char *path) {
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (s < 0 || strlen(path) >= sizeof a.sun_path) return -1;
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    unlink(path);
    if (bind(s, (struct sockaddr *)&a, sizeof a) < 0 || chmod(path, 0600) < 0 || listen(s, 64) < 0) return -1;
    return s;
}

static int sigchld_fd(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);
    return signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
}

static int send_fd_line(int conn, const char *line, int fd) {
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {(void *)line, strlen(line)};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (fd >= 0) {
        mh.msg_control = cbuf;
        mh.msg_controllen = sizeof cbuf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    return sendmsg(conn, &mh, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

static void accept_request(int lsock) {
    int conn = accept4(lsock, NULL, NULL, SOCK_CLOEXEC);
    if (conn < 0) return;
    struct timeval tv = {10, 0};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct req r = {0};
    char err[512] = "bad request";
    int slot = 0;
    while (slot < MAX_CHILDREN && kids[slot].pid) slot++;
    pid_t pid = -1;
    int master = -1;
    if (slot < MAX_CHILDREN && recv_request(conn, &r) == 0) {
        if (r.pty && open_episode_pty(&r, &master) < 0) snprintf(err, sizeof err, "pty: %s", strerror(errno));
        else pid = spawn(&r, err, sizeof err);
    } else if (slot == MAX_CHILDREN) {
        snprintf(err, sizeof err, "too many processes");
    }
    for (int i = 0; i < r.nfds && i < 3; i++) close(r.fds[i]);
    free(r.buf);
    if (pid < 0) {
        if (master >= 0) close(master);
        if (r.nargv) say(conn, "ERR %s\n", err);  /* a probe sends nothing and wants nothing */
        close(conn);
        return;
    }
    char line[64];
    snprintf(line, sizeof line, "PID %d\n", pid);
    send_fd_line(conn, line, master);
    if (master >= 0) close(master);
    kids[slot].pid = pid;
    kids[slot].conn = conn;
}

static void reap(void) {
    int st;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0)
        for (int i = 0; i < MAX_CHILDREN; i++)
            if (kids[i].pid == p) {
                if (kids[i].conn >= 0) {
                    say(kids[i].conn, "EXIT %d %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1,
                        WIFSIGNALED(st) ? WTERMSIG(st) : 0);
                    close(kids[i].conn);
                }
                kids[i].pid = 0;
            }
}

/* Written by an episode's pid 1 as it ends (its id), before its lease closes: serve counts it
 * out at once, so a caller that saw the lease close finds the room free. */
static int ending_pipe[2] = {-1, -1};

static void episode_loop(int lease, int lsock, int sfd, const char *id) {
    struct pollfd pf[MAX_CHILDREN + 3];
    for (;;) {
        int n = 0, idx[MAX_CHILDREN];
        pf[n++] = (struct pollfd){lease, POLLIN, 0};
        pf[n++] = (struct pollfd){lsock, POLLIN, 0};
        pf[n++] = (struct pollfd){sfd, POLLIN, 0};
        for (int i = 0; i < MAX_CHILDREN; i++)
            if (kids[i].pid && kids[i].conn >= 0) {
                idx[n - 3] = i;
                pf[n++] = (struct pollfd){kids[i].conn, POLLIN, 0};
            }
        if (poll(pf, (nfds_t)n, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (pf[0].revents) {
            char b[64];
            if (read(lease, b, sizeof b) <= 0 || strncmp(b, "END", 3) == 0) break;
        }
        if (pf[2].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {}
            reap();
        }
        if (pf[1].revents) accept_request(lsock);
        for (int k = 3; k < n; k++)
            if (pf[k].revents) {
                /* the caller hung up (or sent more than asked): its process goes */
                struct child *c = &kids[idx[k - 3]];
                char b[64];
                if (read(c->conn, b, sizeof b) <= 0) {
                    kill(-c->pid, SIGKILL);
                    kill(c->pid, SIGKILL);
                    close(c->conn);
                    c->conn = -1;
                }
            }
    }
    char note[80];
    snprintf(note, sizeof note, "%s\n", id);
    write_all(ending_pipe[1], note, strlen(note));
    kill(-1, SIGKILL);  /* from pid 1: every other process of the episode */
    _exit(0);
}

struct episode_args {
    char id[64];
    int own_net, conn, close_fds[2];
};

static int send_ready(int conn, int rootfd) {
    char msg[] = "READY\n";
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {msg, sizeof msg - 1};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &rootfd, sizeof(int));
    return sendmsg(conn, &mh, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

static int episode_main(void *arg) {
    struct episode_args *a = arg;
    for (int i = 0; i < 2; i++) close(a->close_fds[i]);
    close(ending_pipe[0]);
    const char *what = "";
    char sock[PATH_MAX];
    snprintf(sock, sizeof sock, IN_DIR "/ep-%s.sock", a->id);
    int sfd = sigchld_fd(), lsock = -1, rootfd = -1;
    int ok = sfd >= 0 && make_root(a->id, a->own_net, &what) == 0;
    if (ok) { what = "episode socket"; ok = (lsock = listen_at(sock)) >= 0; }
    if (ok) { what = "pivot_root"; ok = enter_root(a->id) == 0; }
    if (ok) { what = "root fd"; ok = (rootfd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC)) >= 0; }
    if (ok) { what = "seccomp filter"; ok = install_filter() == 0; }
    if (ok) { what = "dropping the helper's capabilities"; ok = drop_helper_caps() == 0; }
    if (!ok) {
        say(a->conn, "ERR %s: %s\n", what, strerror(errno));
        _exit(1);
    }
    if (send_ready(a->conn, rootfd) < 0) _exit(1);
    close(rootfd);
    episode_loop(a->conn, lsock, sfd, a->id);
    return 0;
}

/* ---- serve: the container's main process ---------------------------------------------- */

static char clone_stack[1 << 20] __attribute__((aligned(16)));

struct episode_rec {
    pid_t pid;
    int ending;
    char id[64];
};

static struct episode_rec episodes[1024];

static int read_line(int fd, char *buf, size_t len) {
    size_t n = 0;
    while (n + 1 < len) {
        ssize_t r = read(fd, buf + n, 1);
        if (r <= 0) return -1;
        if (buf[n] == '\n') break;
        n++;
    }
    buf[n] = 0;
    return 0;
}

static int valid_id(const char *id) {
    size_t n = strlen(id);
    if (n == 0 || n >= 64) return 0;
    for (const char *p = id; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '-' || *p == '_')) return 0;
    return 1;
}

static int capacity = 1, idle_s = 120, quitting;

/* Episodes that said they are ending no longer count (their pid 1 is reaped later). */
static void read_ending(void) {
    char buf[4096], *line, *save = NULL;
    ssize_t n;
    while ((n = read(ending_pipe[0], buf, sizeof buf - 1)) > 0) {
        buf[n] = 0;
        for (line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save))
            for (int i = 0; i < 1024; i++)
                if (episodes[i].pid && strcmp(episodes[i].id, line) == 0) episodes[i].ending = 1;
    }
}

static int live_episodes(void) {
    read_ending();
    int n = 0;
    for (int i = 0; i < 1024; i++) n += episodes[i].pid != 0 && !episodes[i].ending;
    return n;
}

/* Everything in the state dir goes (the directory itself is the host's to remove). */
static void quit(void) {
    DIR *d = opendir(IN_DIR);
    struct dirent *e;
    char path[PATH_MAX];
    while (d && (e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(path, sizeof path, IN_DIR "/%s", e->d_name);
            remove_tree(path);
        }
    if (d) closedir(d);
    exit(0);
}

/* "EPISODE <id> own|shared": a new episode, unless `capacity` are live ("ERR busy").
 * "QUIT": exit if no episode is live. */
static void handle(int conn, int lsock, int sfd) {
    struct timeval tv = {10, 0};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char line[256], id[64] = "", net[16] = "";
    if (read_line(conn, line, sizeof line) < 0) return;
    if (strcmp(line, "QUIT") == 0) {
        say(conn, "BYE\n");
        if (live_episodes() == 0) quit();
        quitting = 1;  /* after the episodes still ending */
        return;
    }
    if (sscanf(line, "EPISODE %63s %15s", id, net) != 2 || !valid_id(id)) {
        say(conn, "ERR bad request\n");
        return;
    }
    int slot = 0;
    while (slot < 1024 && episodes[slot].pid) slot++;
    if (slot == 1024 || live_episodes() >= capacity || quitting) {
        say(conn, "ERR busy\n");
        return;
    }
    struct episode_args a = {.own_net = strcmp(net, "own") == 0, .conn = conn, .close_fds = {lsock, sfd}};
    snprintf(a.id, sizeof a.id, "%s", id);
    int flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (a.own_net ? CLONE_NEWNET : 0);
    pid_t pid = clone(episode_main, clone_stack + sizeof clone_stack, flags | SIGCHLD, &a);
    if (pid < 0) {
        say(conn, "ERR clone: %s\n", strerror(errno));
        return;
    }
    episodes[slot].pid = pid;
    episodes[slot].ending = 0;
    snprintf(episodes[slot].id, sizeof episodes[slot].id, "%s", id);
}

/* An episode ended: its upper layers and socket go (in a child: the next episode need not wait). */
static void reap_episodes(void) {
    int st;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0)
        for (int i = 0; i < 1024; i++)
            if (episodes[i].pid == p) {
                char path[PATH_MAX];
                snprintf(path, sizeof path, IN_DIR "/ep-%s.sock", episodes[i].id);
                unlink(path);
                snprintf(path, sizeof path, IN_DIR "/ep-%s", episodes[i].id);
                episodes[i].pid = 0;
                if (fork() == 0) {
                    remove_tree(path);
                    _exit(0);
                }
            }
}

/* Serve until no episode has been live for `idle_s` seconds (or a QUIT while idle): the
 * container then ends, and podman removes it. */
static void serve(void) {
    if (getcwd(base_cwd, sizeof base_cwd) == NULL) snprintf(base_cwd, sizeof base_cwd, "/");
    gethostname(hostname, sizeof hostname);
    base_env = environ;
    read_mounts();
    signal(SIGPIPE, SIG_IGN);
    int sfd = sigchld_fd();
    int lsock = listen_at(IN_DIR "/ctl.sock");
    if (sfd < 0 || lsock < 0) die("listen on " IN_DIR "/ctl.sock");
    if (pipe2(ending_pipe, O_CLOEXEC) < 0 || fcntl(ending_pipe[0], F_SETFL, O_NONBLOCK) < 0) die("pipe");
    for (;;) {
        struct pollfd pf[2] = {{lsock, POLLIN, 0}, {sfd, POLLIN, 0}};
        int n = poll(pf, 2, live_episodes() ? -1 : idle_s * 1000);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("poll");
        }
        if (n == 0 && live_episodes() == 0) quit();
        if (pf[1].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {}
            reap_episodes();
            if (quitting && live_episodes() == 0) quit();
        }
        if (pf[0].revents) {
            int conn = accept4(lsock, NULL, NULL, SOCK_CLOEXEC);
            if (conn >= 0) {
                handle(conn, lsock, sfd);
                close(conn);
            }
        }
    }
}

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "serve") == 0) {
        snprintf(image_user, sizeof image_user, "%s", argv[2]);
        capacity = atoi(argv[3]) > 0 ? atoi(argv[3]) : 1;
        idle_s = atoi(argv[4]) > 0 ? atoi(argv[4]) : 1;
        serve();
    }
    fprintf(stderr, "usage: tmax-eph serve IMAGE_USER CAPACITY IDLE_SECONDS\n");
    return 2;
}
