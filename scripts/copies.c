/* Bytes copied by memcpy and memmove, per call site: an LD_PRELOAD interposer for
 * `scripts/instructions.sh` (COPIES=1; docs/performance.md, "Futures and bodies copied
 * whole").
 *
 * Each call is counted under its return address (calls and bytes, in a fixed table
 * of atomic counters, so the proxy's threads need no lock); at exit the table is
 * written to $COPIES_OUT, one line per site: object file, offset in it, calls, bytes.
 * Copies the compiler inlines (small fixed sizes) never call memcpy and are not seen.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define SLOTS 65536

static struct {
  uintptr_t site;
  unsigned long calls, bytes;
} table[SLOTS];
static void *(*real_memcpy)(void *, const void *, size_t);
static void *(*real_memmove)(void *, const void *, size_t);
static int counting;

static void count(uintptr_t site, size_t n) {
  if (!counting) return;
  unsigned h = (unsigned)((site >> 2) * 2654435761u) % SLOTS;
  for (unsigned i = 0; i < SLOTS; i++) {
    unsigned j = (h + i) % SLOTS;
    uintptr_t seen = __atomic_load_n(&table[j].site, __ATOMIC_RELAXED);
    if (seen == 0) {
      uintptr_t empty = 0;
      if (!__atomic_compare_exchange_n(&table[j].site, &empty, site, 0, __ATOMIC_RELAXED,
                                       __ATOMIC_RELAXED))
        seen = empty; /* another thread took the slot: is it ours? */
      else
        seen = site;
    }
    if (seen == site) {
      __atomic_fetch_add(&table[j].calls, 1, __ATOMIC_RELAXED);
      __atomic_fetch_add(&table[j].bytes, n, __ATOMIC_RELAXED);
      return;
    }
  }
}

/* Before the constructor has looked the real functions up (the loader may copy
 * first), a byte loop does the work. */
void *memcpy(void *dst, const void *src, size_t n) {
  if (!real_memcpy) {
    char *d = dst;
    const char *s = src;
    for (size_t i = 0; i < n; i++) d[i] = s[i];
    return dst;
  }
  count((uintptr_t)__builtin_return_address(0), n);
  return real_memcpy(dst, src, n);
}

void *memmove(void *dst, const void *src, size_t n) {
  if (!real_memmove) {
    char *d = dst;
    const char *s = src;
    if (d < s)
      for (size_t i = 0; i < n; i++) d[i] = s[i];
    else
      for (size_t i = n; i > 0; i--) d[i - 1] = s[i - 1];
    return dst;
  }
  count((uintptr_t)__builtin_return_address(0), n);
  return real_memmove(dst, src, n);
}

__attribute__((constructor)) static void start(void) {
  real_memcpy = dlsym(RTLD_NEXT, "memcpy");
  real_memmove = dlsym(RTLD_NEXT, "memmove");
  counting = 1;
}

__attribute__((destructor)) static void finish(void) {
  counting = 0;
  const char *path = getenv("COPIES_OUT");
  FILE *out = path ? fopen(path, "w") : NULL;
  if (!out) return;
  for (unsigned i = 0; i < SLOTS; i++) {
    if (!table[i].site) continue;
    Dl_info info;
    const char *file = "?";
    uintptr_t offset = table[i].site;
    if (dladdr((void *)table[i].site, &info) && info.dli_fname) {
      file = info.dli_fname;
      offset -= (uintptr_t)info.dli_fbase;
    }
    fprintf(out, "%s 0x%lx %lu %lu\n", file, (unsigned long)offset, table[i].calls,
            table[i].bytes);
  }
  fclose(out);
}
