/* Another preloaded interposer, loaded after libvcuda: its puts finds the real one with
 * dlsym(RTLD_NEXT, "puts"). libvcuda's dlsym must search after *this* library (its caller),
 * not after libvcuda, or the lookup returns this very function and puts recurses forever. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

int puts(const char *s) {
    static int (*real)(const char *);
    if (!real) real = (int (*)(const char *))dlsym(RTLD_NEXT, "puts");
    if (!real || real == puts) {
        static const char msg[] = "interposer: dlsym(RTLD_NEXT, \"puts\") did not find libc's puts\n";
        fwrite(msg, 1, sizeof msg - 1, stderr);
        return EOF;
    }
    fputs("[interposed] ", stdout);
    return real(s);
}
