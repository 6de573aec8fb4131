/* Frozen layers: the upper layers of an ended episode, kept read-only as lower layers of new
 * episodes (a fork). A layer is STATE_DIR/layers/<id>/<idx> per overlay of the episode (0 the
 * root, i+1 the container's i-th writable mount), its `below` the layer its episode stood
 * on. A layer lives while an episode stands on it, a layer above it stands on it, or new
 * episodes are reserved on it (for a while: a forker that died leaves nothing for long).
 * Past MAX_CHAIN layers in a chain, the chain is merged into one layer of hard links (frozen
 * layers are never written, so their files can be shared), whiteouts and opaque directories
 * applied in order: an episode's overlay never stacks more than MAX_CHAIN layers. */
#include "helper.h"
#include <sys/xattr.h>

struct layer layers[MAX_LAYERS];

struct layer *find_layer(const char *id) {
    for (int i = 0; i < MAX_LAYERS; i++)
        if (layers[i].refs > 0 && strcmp(layers[i].id, id) == 0) return &layers[i];
    return NULL;
}

static struct layer *new_layer(const char *id) {
    for (int i = 0; i < MAX_LAYERS; i++)
        if (layers[i].refs == 0) {
            memset(&layers[i], 0, sizeof layers[i]);
            snprintf(layers[i].id, sizeof layers[i].id, "%s", id);
            return &layers[i];
        }
    return NULL;
}

void layer_path(char *out, size_t n, const char *id, int idx) {
    if (idx < 0) snprintf(out, n, IN_DIR "/layers/%s", id);
    else snprintf(out, n, IN_DIR "/layers/%s/%d", id, idx);
}

/* One reference less; the last one removes the layer (in a child: serve need not wait) and
 * lets go of the layer below. */
void unref_layer(const char *id) {
    while (id && *id) {
        struct layer *l = find_layer(id);
        if (!l || --l->refs > 0) return;
        char path[PATH_MAX];
        layer_path(path, sizeof path, l->id, -1);
        if (fork() == 0) {
            remove_tree(path);
            _exit(0);
        }
        static char below[64];
        snprintf(below, sizeof below, "%s", l->below);
        id = below;
    }
}

void ref_layer(const char *id) {
    struct layer *l = id && *id ? find_layer(id) : NULL;
    if (l) l->refs++;
}

/* ---- holds: the rooms a FREEZE reserved ----------------------------------------------- */

struct hold holds[MAX_HOLDS];

int reserved_episodes(void) {
    int n = 0;
    for (int i = 0; i < MAX_HOLDS; i++)
        if (holds[i].active) n += holds[i].reserved;
    return n;
}

struct hold *add_hold(int conn, const char *layer, int n) {
    for (int i = 0; i < MAX_HOLDS; i++)
        if (!holds[i].active) {
            holds[i] = (struct hold){.active = 1, .conn = conn, .reserved = n};
            snprintf(holds[i].layer, sizeof holds[i].layer, "%s", layer);
            return &holds[i];
        }
    return NULL;
}

int free_holds(void) {
    int n = 0;
    for (int i = 0; i < MAX_HOLDS; i++) n += !holds[i].active;
    return n;
}

/* Takes one room reserved on `layer`; 0 when none is left. Its reference on the layer is the
 * new episode's. */
int take_reservation(const char *layer) {
    for (int i = 0; i < MAX_HOLDS; i++)
        if (holds[i].active && holds[i].reserved > 0 && strcmp(holds[i].layer, layer) == 0) {
            holds[i].reserved--;
            return 1;
        }
    return 0;
}

/* One room given back ("DROP" on the hold's connection). */
void drop_reservation(struct hold *h) {
    if (h->reserved <= 0) return;
    h->reserved--;
    unref_layer(h->layer);
}

/* The forker closed its connection (or died): the rooms it did not take go back. */
void end_hold(struct hold *h) {
    while (h->reserved > 0) drop_reservation(h);
    close(h->conn);
    h->active = 0;
}

int layer_chain(const char *top, const char **chain, int max) {
    int n = 0;
    for (struct layer *l = top && *top ? find_layer(top) : NULL; l && n < max; l = l->below[0] ? find_layer(l->below) : NULL)
        chain[n++] = l->id;
    return n;
}

/* ---- merging a chain -------------------------------------------------------------------- */

static int is_opaque(const char *dir) {
    char v[4];
    ssize_t n = lgetxattr(dir, "trusted.overlay.opaque", v, sizeof v);
    return n > 0 && v[0] == 'y';
}

/* A directory's owner, mode, times and xattrs (the overlay's own, but for opaque, left out). */
static void copy_dir_meta(const char *src, const char *dst, const struct stat *st) {
    lchown(dst, st->st_uid, st->st_gid);
    chmod(dst, st->st_mode & 07777);
    char names[4096], val[4096];
    ssize_t n = llistxattr(src, names, sizeof names);
    for (char *k = names; n > 0 && k < names + n; k += strlen(k) + 1) {
        if (strncmp(k, "trusted.overlay.", 16) == 0 && strcmp(k, "trusted.overlay.opaque") != 0) continue;
        ssize_t v = lgetxattr(src, k, val, sizeof val);
        if (v >= 0) lsetxattr(dst, k, val, (size_t)v, 0);
    }
    struct timespec ts[2] = {st->st_atim, st->st_mtim};
    utimensat(AT_FDCWD, dst, ts, AT_SYMLINK_NOFOLLOW);
}

/* Lay `src` (a layer's directory) over `dst` (the merge so far): its entries replace what
 * is there, an opaque directory replaces a directory whole, files and whiteouts go in as
 * hard links. */
static int apply_layer(const char *src, const char *dst) {
    DIR *d = opendir(src);
    if (!d) return -1;
    struct dirent *e;
    int rc = 0;
    while (rc == 0 && (e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        char s[PATH_MAX], t[PATH_MAX];
        if (snprintf(s, sizeof s, "%s/%s", src, e->d_name) >= (int)sizeof s ||
            snprintf(t, sizeof t, "%s/%s", dst, e->d_name) >= (int)sizeof t) { rc = -1; break; }
        struct stat ss, ts;
        if (lstat(s, &ss) < 0) { rc = -1; break; }
        int there = lstat(t, &ts) == 0;
        if (S_ISDIR(ss.st_mode)) {
            if (there && (!S_ISDIR(ts.st_mode) || is_opaque(s))) { remove_tree(t); there = 0; }
            if (!there && mkdir(t, 0700) < 0) { rc = -1; break; }
            rc = apply_layer(s, t);
            copy_dir_meta(s, t, &ss);  /* after its contents: their writes changed its times */
        } else {
            if (there) remove_tree(t);
            if (link(s, t) < 0) rc = -1;
        }
    }
    closedir(d);
    return rc;
}

/* A new layer `id` holding what the chain `top` (and the layers below it) hold, in one. */
int merge_chain(const char *top, const char *id) {
    const char *chain[MAX_CHAIN + 2];
    int n = layer_chain(top, chain, MAX_CHAIN + 2);
    char dst[PATH_MAX], src[PATH_MAX], sub[PATH_MAX + 16];
    layer_path(dst, sizeof dst, id, -1);
    if (mkdir(dst, 0700) < 0) return -1;
    for (int idx = 0; idx <= n_mounts; idx++) {
        int made = 0;
        for (int k = n - 1; k >= 0; k--) {  /* bottom first: the upper layers win */
            layer_path(src, sizeof src, chain[k], idx);
            struct stat st;
            if (stat(src, &st) < 0) continue;
            snprintf(sub, sizeof sub, "%s/%d", dst, idx);
            if (!made && mkdir(sub, st.st_mode & 07777) < 0) return -1;
            made = 1;
            if (apply_layer(src, sub) < 0) return -1;
            copy_dir_meta(src, sub, &st);
        }
    }
    return 0;
}

/* Episode `id`'s upper layers (STATE_DIR/ep-<id>/u, unmounted: the episode is over) become
 * layer `id` on `below`, referenced for `n` new episodes; merged when the chain is too deep.
 * Returns the layer to start them on, NULL on failure (errno set). */
struct layer *freeze_layers(const char *id, const char *below, int n, int *depth) {
    char from[PATH_MAX], to[PATH_MAX];
    snprintf(to, sizeof to, IN_DIR "/layers");
    if (mkdir(to, 0700) < 0 && errno != EEXIST) return NULL;
    snprintf(from, sizeof from, IN_DIR "/ep-%s/u", id);
    layer_path(to, sizeof to, id, -1);
    struct layer *l = new_layer(id);
    if (!l) { errno = ENOSPC; return NULL; }
    if (rename(from, to) < 0) return NULL;
    snprintf(l->below, sizeof l->below, "%s", below ? below : "");
    struct layer *b = l->below[0] ? find_layer(l->below) : NULL;
    l->depth = b ? b->depth + 1 : 1;
    l->refs = n;  /* one per room reserved; the episode's reference on `below` is the layer's now */
    if (l->depth <= MAX_CHAIN) {
        *depth = l->depth;
        return l;
    }
    char merged[64];
    snprintf(merged, sizeof merged, "%.60s-m", id);
    if (merge_chain(l->id, merged) < 0) {
        int err = errno;
        layer_path(to, sizeof to, merged, -1);
        remove_tree(to);
        errno = err;
        return l;  /* a deep chain still works (up to the kernel's own limit of layers) */
    }
    struct layer *m = new_layer(merged);
    if (!m) { *depth = l->depth; return l; }
    m->depth = 1;
    m->refs = n;
    for (int k = 0; k < n; k++) unref_layer(l->id);
    *depth = 1;
    return m;
}
