// Command inferscale-k8s is one multi-call binary for the e2e's real control plane: the first
// argument picks kube-apiserver, kube-controller-manager, kube-scheduler or etcd, and the rest are
// that program's own flags. One binary, because the four share most of their packages: compiled and
// linked once, a cold build on a small machine takes a fraction of four separate ones.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func commands() map[string]func() *cobra.Command {
	return map[string]func() *cobra.Command{
		"kube-apiserver":          apiserver.NewAPIServerCommand,
		"kube-controller-manager": controllermanager.NewControllerManagerCommand,
		"kube-scheduler": func() *cobra.Command {
			return scheduler.NewSchedulerCommand()
		},
	}
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: inferscale-k8s kube-apiserver|kube-controller-manager|kube-scheduler|etcd [flags]")
		os.Exit(2)
	}
	name := os.Args[1]
	if name == "etcd" {
		etcdmain.Main(append([]string{"etcd"}, os.Args[2:]...))
		return
	}
	build, ok := commands()[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "inferscale-k8s: unknown command %q\n", name)
		os.Exit(2)
	}
	command := build()
	command.SetArgs(os.Args[2:])
	os.Exit(cli.Run(command))
}
