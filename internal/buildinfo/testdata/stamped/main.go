// Command stamped prints its build (TestStampedByTheLinker).
package main

import (
	"fmt"

	"github.com/proxyaudit/proxyaudit/internal/buildinfo"
)

func main() { fmt.Print(buildinfo.Get().String()) }
