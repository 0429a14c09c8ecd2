from zerod.cli import main

main()
