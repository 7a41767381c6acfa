module github.com/goalloc/goalloc

go 1.26
