/* The sandbox ("pause") process of the local node's Pods: containerd starts one per Pod
 * to hold its namespaces. It sleeps until SIGTERM or SIGINT (then exits 0) and reaps any
 * child re-parented to it, since it is PID 1 of a shared PID namespace.
 * Built static by hack/build-images (gcc -static) into an image from scratch. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

int main(void) {
    sigset_t wanted;
    sigemptyset(&wanted);
    sigaddset(&wanted, SIGTERM);
    sigaddset(&wanted, SIGINT);
    sigaddset(&wanted, SIGCHLD);
    /* Blocked, so they queue for sigwait instead of running a default action. */
    if (sigprocmask(SIG_BLOCK, &wanted, NULL) != 0) {
        fprintf(stderr, "pause: sigprocmask: %s\n", strerror(errno));
        return 1;
    }
    for (;;) {
        int sig = 0;
        if (sigwait(&wanted, &sig) != 0)
            continue;
        if (sig == SIGCHLD) {
            while (waitpid(-1, NULL, WNOHANG) > 0) {
            }
            continue;
        }
        return 0; /* SIGTERM or SIGINT */
    }
}
