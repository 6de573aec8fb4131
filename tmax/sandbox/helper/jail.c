/* What an episode's processes may not do (seccomp, capabilities), whom they run as, and
 * how they start. */
#include "helper.h"

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
int install_filter(void) {
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

int drop_helper_caps(void) {
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


int recv_request(int conn, struct req *r) {
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
int open_episode_pty(struct req *r, int *master) {
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

pid_t spawn(struct req *r, char *err, size_t errlen) {
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
