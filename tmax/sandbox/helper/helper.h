/* The episode helper's shared declarations (tmax/sandbox/helper/: main.c serves episodes,
 * root.c makes an episode's root, jail.c its processes' limits, users and spawning). */
#ifndef TMAX_EPH_HELPER_H
#define TMAX_EPH_HELPER_H
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
#define MAX_LAYERS 1024
#define MAX_CHAIN 8  /* frozen layers under an episode at most: a deeper chain is merged (layers.c) */
#define IN_DIR "/run/tmax-eph"   /* where the state dir is mounted in the container */
#define IN_BIN "/run/tmax-eph.bin"

extern char **environ;

/* A mount of the container, as serve saw it at its start (root.c). */
struct mnt {
    char point[PATH_MAX];
    char fstype[64];
    int ro, is_file;
};

extern struct mnt mounts[MAX_MOUNTS];
extern int n_mounts;
extern char image_user[256], base_cwd[PATH_MAX], hostname[256];
extern char shm_opts[128];
extern char **base_env;

struct who {
    uid_t uid;
    gid_t gid;
    char home[PATH_MAX];
    gid_t groups[64];
    int ngroups;
};

struct req {
    char *buf;
    int fds[3], nfds, pty, rows, cols;
    const char *user, *cwd;
    char *env[512], *argv[4096];
    int nenv, nargv;
};

/* A frozen layer (layers.c). */
struct layer {
    char id[64], below[64];
    int depth, refs;
};

/* Rooms a FREEZE reserved for episodes on its layer, held by its connection (layers.c). */
struct hold {
    int active, conn, reserved;
    char layer[64];
};

#define MAX_HOLDS 64
extern struct layer layers[MAX_LAYERS];
extern struct hold holds[MAX_HOLDS];

void die(const char *what);
int write_all(int fd, const void *buf, size_t n);
void say(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void read_mounts(void);
void remove_tree(const char *path);
int make_root(const char *id, int own_net, const char **chain, int nchain, const char **what);
struct layer *find_layer(const char *id);
void layer_path(char *out, size_t n, const char *id, int idx);
void ref_layer(const char *id);
void unref_layer(const char *id);
int reserved_episodes(void);
struct hold *add_hold(int conn, const char *layer, int n);
int free_holds(void);
int take_reservation(const char *layer);
void drop_reservation(struct hold *h);
void end_hold(struct hold *h);
int layer_chain(const char *top, const char **chain, int max);
struct layer *freeze_layers(const char *id, const char *below, int n, int *depth);
int enter_root(const char *id);
int install_filter(void);
int drop_helper_caps(void);
int recv_request(int conn, struct req *r);
int open_episode_pty(struct req *r, int *master);
pid_t spawn(struct req *r, char *err, size_t errlen);

#endif
