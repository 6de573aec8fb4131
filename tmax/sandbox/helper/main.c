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
#include "helper.h"

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
                    kids[i].conn = -1;
                }
                kids[i].pid = 0;
            }
}

/* The caller of `c` hung up (or sent more than asked): its process group goes. Only a live
 * slot: kill(-0) would be kill(0), this process's own group, which is serve's. */
static void hang_up(struct child *c) {
    char b[64];
    if (c->pid <= 0 || c->conn < 0 || read(c->conn, b, sizeof b) > 0) return;
    kill(-c->pid, SIGKILL);
    kill(c->pid, SIGKILL);
    close(c->conn);
    c->conn = -1;
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
        /* Hang-ups first, while the slots are those polled: a process that ended meanwhile
         * is reaped below (its slot freed, and maybe taken by a new request). */
        for (int k = 3; k < n; k++)
            if (pf[k].revents) hang_up(&kids[idx[k - 3]]);
        if (pf[2].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {}
            reap();
        }
        if (pf[1].revents) accept_request(lsock);
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
    const char *chain[MAX_CHAIN + 1];  /* the frozen layers it stands on, top first */
    int nchain;
};

static int send_ready(int conn, int rootfd) {
    return send_fd_line(conn, "READY\n", rootfd);
}

static int episode_main(void *arg) {
    struct episode_args *a = arg;
    setsid();  /* a group of its own: no signal to its group reaches serve or another episode */
    for (int i = 0; i < 2; i++) close(a->close_fds[i]);
    for (int i = 0; i < MAX_HOLDS; i++)
        if (holds[i].active) close(holds[i].conn);  /* serve's, not the episode's */
    close(ending_pipe[0]);
    const char *what = "";
    char sock[PATH_MAX];
    snprintf(sock, sizeof sock, IN_DIR "/ep-%s.sock", a->id);
    int sfd = sigchld_fd(), lsock = -1, rootfd = -1;
    int ok = sfd >= 0 && make_root(a->id, a->own_net, a->chain, a->nchain, &what) == 0;
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
    char layer[64];  /* the frozen layer it stands on ("": the container's root) */
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

/* Live episodes and those reserved for forks (a fork's room is taken before its parent ends). */
static int live_episodes(void) {
    read_ending();
    int n = reserved_episodes();
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

static int find_episode(const char *id) {
    for (int i = 0; i < 1024; i++)
        if (episodes[i].pid && !episodes[i].ending && strcmp(episodes[i].id, id) == 0) return i;
    return -1;
}

/* "FREEZE <id> <n>": episode <id> ends (its processes killed) and its upper layers become a
 * read-only layer for <n> new episodes, whose room is reserved now ("ERR busy", the episode
 * untouched, when the host has none); answers "OK <layer> <depth>" and keeps the connection
 * as the rooms' hold: "DROP" on it gives one back, its close all that are left. Returns
 * whether it keeps the connection. */
static int freeze(int conn, const char *id, int n) {
    read_ending();
    int slot = find_episode(id);
    if (slot < 0 || n < 1) {
        say(conn, "ERR no such episode\n");
        return 0;
    }
    if (live_episodes() - 1 + n > capacity || quitting || free_holds() == 0) {
        say(conn, "ERR busy\n");
        return 0;
    }
    pid_t pid = episodes[slot].pid;
    kill(pid, SIGKILL);  /* its pid 1: the kernel kills the rest, and its mounts go with it */
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {}
    episodes[slot].pid = 0;
    char path[PATH_MAX];
    snprintf(path, sizeof path, IN_DIR "/ep-%s.sock", id);
    unlink(path);
    int depth = 0;
    struct layer *l = freeze_layers(id, episodes[slot].layer, n, &depth);
    if (!l) {
        say(conn, "ERR freezing the layers: %s\n", strerror(errno));
        unref_layer(episodes[slot].layer);
    } else {
        add_hold(conn, l->id, n);  /* a slot is free: checked above */
        say(conn, "OK %s %d\n", l->id, depth);
    }
    snprintf(path, sizeof path, IN_DIR "/ep-%s", id);
    if (fork() == 0) {
        remove_tree(path);
        _exit(0);
    }
    return l != NULL;
}

/* "EPISODE <id> own|shared [<layer> [held]]": a new episode, unless `capacity` are live ("ERR
 * busy"), on a frozen layer when named (with "held", in a room its FREEZE kept, if one is left).
 * "FREEZE <id> <n>": see freeze. "QUIT": exit if no episode is live.
 * Returns whether the connection stays open (a hold). */
static int handle(int conn, int lsock, int sfd) {
    struct timeval tv = {10, 0};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char line[256], id[64] = "", net[16] = "", top[64] = "", how[16] = "";
    int n = 0;
    if (read_line(conn, line, sizeof line) < 0) return 0;
    if (strcmp(line, "QUIT") == 0) {
        say(conn, "BYE\n");
        if (live_episodes() == 0) quit();
        quitting = 1;  /* after the episodes still ending */
        return 0;
    }
    if (sscanf(line, "FREEZE %63s %d", id, &n) == 2) return freeze(conn, id, n);
    if (sscanf(line, "EPISODE %63s %15s %63s %15s", id, net, top, how) < 2 || !valid_id(id)) {
        say(conn, "ERR bad request\n");
        return 0;
    }
    struct layer *l = top[0] ? find_layer(top) : NULL;
    if (top[0] && !l) {
        say(conn, "ERR no such layer\n");
        return 0;
    }
    int slot = 0;
    while (slot < 1024 && episodes[slot].pid) slot++;
    int reserved = slot < 1024 && l && !quitting && strcmp(how, "held") == 0 && take_reservation(l->id);
    if (!reserved && (slot == 1024 || live_episodes() >= capacity || quitting)) {
        say(conn, "ERR busy\n");
        return 0;
    }
    if (l && !reserved) ref_layer(l->id);  /* a reservation's reference is the episode's now */
    struct episode_args a = {.own_net = strcmp(net, "own") == 0, .conn = conn, .close_fds = {lsock, sfd}};
    snprintf(a.id, sizeof a.id, "%s", id);
    a.nchain = layer_chain(top, a.chain, MAX_CHAIN + 1);
    int flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (a.own_net ? CLONE_NEWNET : 0);
    pid_t pid = clone(episode_main, clone_stack + sizeof clone_stack, flags | SIGCHLD, &a);
    if (pid < 0) {
        say(conn, "ERR clone: %s\n", strerror(errno));
        if (l) unref_layer(l->id);
        return 0;
    }
    episodes[slot].pid = pid;
    episodes[slot].ending = 0;
    snprintf(episodes[slot].id, sizeof episodes[slot].id, "%s", id);
    snprintf(episodes[slot].layer, sizeof episodes[slot].layer, "%s", top);
    return 0;
}

/* Something on a hold's connection: "DROP" lines give rooms back; its end, all that are left. */
static void hold_event(struct hold *h) {
    char buf[256];
    ssize_t n = read(h->conn, buf, sizeof buf);
    if (n <= 0) {
        end_hold(h);
        return;
    }
    for (ssize_t i = 0; i + 4 <= n; i++)
        if (memcmp(buf + i, "DROP", 4) == 0) drop_reservation(h);
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
                unref_layer(episodes[i].layer);
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
        struct pollfd pf[2 + MAX_HOLDS] = {{lsock, POLLIN, 0}, {sfd, POLLIN, 0}};
        int npf = 2, which[MAX_HOLDS];
        for (int i = 0; i < MAX_HOLDS; i++)
            if (holds[i].active) {
                which[npf - 2] = i;
                pf[npf++] = (struct pollfd){holds[i].conn, POLLIN, 0};
            }
        int n = poll(pf, (nfds_t)npf, live_episodes() ? -1 : idle_s * 1000);
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
        for (int k = 2; k < npf; k++)
            if (pf[k].revents) hold_event(&holds[which[k - 2]]);
        if (quitting && live_episodes() == 0) quit();
        if (pf[0].revents) {
            int conn = accept4(lsock, NULL, NULL, SOCK_CLOEXEC);
            if (conn >= 0 && !handle(conn, lsock, sfd)) close(conn);
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
