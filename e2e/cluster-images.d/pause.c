/*
 * pause: the process that holds a Pod's namespaces (containerd's sandbox_image), for the
 * test bed's node (e2e/cluster-images builds it into localhost/dbops-test/pause).
 * Written here because this machine reaches no registry.k8s.io; it does what the
 * Kubernetes pause binary does: as PID 1 of the sandbox it sleeps, reaps the children
 * it inherits, and exits 0 on SIGINT or SIGTERM.
 *
 *   gcc -static -Os -o pause pause.c && strip pause
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define VERSION "dbops-test-pause 1"

static void on_stop(int sig) {
    (void)sig;
    _exit(0);
}

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && (strcmp(argv[1], "-v") == 0 || strcmp(argv[1], "--version") == 0)) {
        puts(VERSION);
        return 0;
    }
    if (getpid() != 1)
        fprintf(stderr, "pause: warning: not PID 1\n");

    /* Nothing but the three signals below reaches us; they interrupt pause(). */
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);

    struct sigaction stop = {.sa_handler = on_stop};
    sigfillset(&stop.sa_mask);
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    sigfillset(&child.sa_mask);
    if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
        sigaction(SIGCHLD, &child, NULL) < 0) {
        perror("pause: sigaction");
        return 1;
    }
    sigset_t wanted;
    sigemptyset(&wanted);
    sigaddset(&wanted, SIGINT);
    sigaddset(&wanted, SIGTERM);
    sigaddset(&wanted, SIGCHLD);
    sigprocmask(SIG_UNBLOCK, &wanted, NULL);

    for (;;)
        pause();
    /* not reached */
    return 42;
}
